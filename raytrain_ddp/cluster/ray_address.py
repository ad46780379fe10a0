"""RAY_ADDRESS, checked in seconds before Ray starts: Ray itself waits for minutes, printing a warning
every 30 s, on an address where nothing answers, and answers a dashboard address (the one
`ray job submit` takes) with a traceback. No Ray imported here: the command line refuses a wrong
address before it loads torch and Ray.

    RAY_ADDRESS      what happens
    (unset), local   a local Ray is started
    auto             Ray's own: the cluster started on this machine (`ray start`)
    host:port        joined, if something accepts a TCP connection there within 3 s; else refused
    http(s)://host…  the dashboard: joined at host:6379 (the default GCS port) if that answers, saying
                     so; else refused, with the GCS address and the `ray job submit` command to use
    ray://…          Ray Client: refused (not supported), with what to use instead
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

ADDRESS_ENV = "RAY_ADDRESS"
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # Ray's token auth: `token`, or `disabled`; unset: on where a token exists
GCS_PORT = 6379  # Ray's default: where a driver joins a cluster (`ray start --head --port`)
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RayAddress:
    """What RAY_ADDRESS comes to: the address to join (None: start a local Ray, or use the one this
    process has), a note for the user, or the problem that rules it out."""

    join: str | None = None
    note: str | None = None
    problem: str | None = None


def check_environment() -> RayAddress:
    """RAY_ADDRESS, checked (`check`)."""
    return check(os.environ.get(ADDRESS_ENV, ""))


def check(value: str, timeout_s: float = PROBE_TIMEOUT_S, gcs_port: int = GCS_PORT) -> RayAddress:
    """A Ray address checked in seconds: empty or `local` starts a local Ray; `auto` is Ray's (a cluster
    started on this machine); `host:port` must accept a connection within `timeout_s`; a dashboard
    address (`http://host:8265`, what `ray job submit` takes) is joined at `gcs_port` of the same
    host when that answers, else refused with what to use instead; Ray Client (`ray://`) is refused."""
    value = value.strip()
    if value in ("", "local"):
        return RayAddress()
    if value == "auto":
        return RayAddress(join="auto")
    submit = "ray job submit --address http://<head>:8265 --working-dir . -- raytrain-ddp train <job> ..."
    if value.startswith("ray://"):
        return RayAddress(
            problem=f"{ADDRESS_ENV}={value}: Ray Client (ray://) is not supported (Ray's own docs steer Ray Train "
            f"work to the Jobs API); run the driver on the cluster: {submit}, or on a cluster node with "
            f"{ADDRESS_ENV}=auto"
        )
    if value.startswith(("http://", "https://")):
        host = urlsplit(value).hostname or ""
        gcs = f"{host}:{gcs_port}"
        if host and _answers(host, gcs_port, timeout_s) is None:
            return RayAddress(
                join=gcs,
                note=f"{ADDRESS_ENV}={value} is the dashboard's address (for `ray job submit`); joining the "
                f"cluster at its GCS address {gcs} (set {ADDRESS_ENV}={gcs} to say so)",
            )
        return RayAddress(
            problem=f"{ADDRESS_ENV}={value} is a dashboard address, which `ray job submit` takes, not a driver; "
            f"nothing answers at the GCS address {gcs} either. Submit the job: {submit}; or join the cluster "
            f"from a machine that reaches its GCS: {ADDRESS_ENV}=<head>:{gcs_port} (the head's `ray start "
            f"--port`), or {ADDRESS_ENV}=auto on a cluster node; or unset {ADDRESS_ENV} to start a local Ray"
        )
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return RayAddress(
            problem=f"{ADDRESS_ENV}={value}: expected host:port (the cluster's GCS address, e.g. 10.0.0.5:{GCS_PORT}), "
            f"auto (a cluster on this machine), or unset it to start a local Ray"
        )
    if (reason := _answers(host, int(port), timeout_s)) is not None:
        return RayAddress(
            problem=f"{ADDRESS_ENV}={value}: no Ray cluster answers there ({reason}); start the cluster "
            f"(`ray start --head --port={port}`), correct the address (the head's GCS address, host:{GCS_PORT} "
            f"by default), or unset {ADDRESS_ENV} to start a local Ray"
        )
    return RayAddress(join=value)


def token_hint() -> str:
    """Why a cluster that answers may still refuse to be joined: its token auth (on by default where
    `ray start` or `ray.init` made the cluster) refuses a process that sends no token, or another one."""
    mode = os.environ.get(AUTH_MODE_ENV)
    where = "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token"
    if mode is not None and mode.lower() != "token":
        shown = mode or '""'
        return (
            f"{AUTH_MODE_ENV}={shown} sends no token, which a cluster with token auth (Ray's default) refuses: "
            f"set {AUTH_MODE_ENV}=token, or unset it, with the cluster's token in {where}"
        )
    return f"a cluster with token auth (Ray's default) takes only its own token: {where}"


def _answers(host: str, port: int, timeout_s: float) -> str | None:
    """None if `host:port` accepts a TCP connection within `timeout_s`, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror:
        return "unknown host"
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no connection within {timeout_s:g} s"
    except OSError as e:
        return e.strerror or type(e).__name__
