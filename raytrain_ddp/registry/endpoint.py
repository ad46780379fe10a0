"""The tracking URI: resolved (`mlflow.tracking_uri`, else $MLFLOW_TRACKING_URI, else sqlite), probed
in seconds before anything starts (`check_server`), and the command that opens its UI."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(setting: str | None) -> str:
    """Config, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; relative sqlite paths made absolute,
    because Ray's processes that use it (the registering task's) do not share the driver's working directory."""
    uri = setting or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri.removeprefix(prefix)).resolve())
    return uri


def check_server(tracking_uri: str, connect_timeout_s: float = 3.0, answer_timeout_s: float = 60.0) -> str | None:
    """For an HTTP(S) tracking server: one API call, with the environment's credentials and no
    retries, so a server that is down or unreachable (no connection within `connect_timeout_s`), or
    that refuses the credentials, is reported in seconds, before anything trains (MLflow's own client
    retries for minutes). A server that accepts the connection gets `answer_timeout_s` to answer: a
    busy server's first call can be slow. Returns the problem, or None; never shows credentials."""
    if not is_server(tracking_uri):
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(
            get_default_host_creds(tracking_uri),
            "/api/2.0/mlflow/experiments/search",
            "GET",
            params={"max_results": 1},
            max_retries=0,
            timeout=(connect_timeout_s, answer_timeout_s),
            raise_on_status=False,
        )
    except MlflowException as e:
        return (
            f"mlflow.tracking_uri: the MLflow tracking server {tracking_uri} is unreachable "
            f"({_network_reason(e.__cause__ or e.__context__, connect_timeout_s, answer_timeout_s)}); start it, "
            "or point mlflow.tracking_uri (or MLFLOW_TRACKING_URI) at one that runs"
        )
    if response.status_code in (401, 403):
        return (
            f"mlflow.tracking_uri: the MLflow tracking server {tracking_uri} refused the credentials "
            f"(HTTP {response.status_code}); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
            "(or MLFLOW_TRACKING_TOKEN) in the environment"
        )
    if response.status_code != 200:
        return (
            f"mlflow.tracking_uri: {tracking_uri} does not answer like an MLflow tracking server "
            f"(HTTP {response.status_code} for its experiments API)"
        )
    return None


def _network_reason(error: BaseException | None, connect_timeout_s: float, answer_timeout_s: float) -> str:
    text = str(error)
    for marker, reason in (
        ("Connection refused", "connection refused"),
        ("connect timeout", f"no connection within {connect_timeout_s:g} s"),
        ("Read timed out", f"connected, but no answer within {answer_timeout_s:g} s"),
        ("Name or service not known", "unknown host"),
        ("Failed to resolve", "unknown host"),
    ):
        if marker in text:
            return reason
    return type(error).__name__


def is_server(tracking_uri: str) -> bool:
    """A tracking server (HTTP), not a store this process opens itself (a database, say)."""
    return tracking_uri.startswith(("http://", "https://"))


def ui_command(tracking_uri: str) -> str:
    if is_server(tracking_uri):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def sqlite_file(tracking_uri: str) -> Path | None:
    """The file of a sqlite tracking URI (`sqlite:///relative.db`, `sqlite:////absolute.db`), else None."""
    scheme, _, rest = tracking_uri.partition(":")
    path = rest.removeprefix("///") if scheme == "sqlite" and rest.startswith("///") else ""
    return Path(path) if path else None


def mlflow_client(tracking_uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri)
