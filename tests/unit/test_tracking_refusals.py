"""A tracking server that cannot be reached is refused in seconds, before Ray starts or anything is
written. (A real server, with credentials, that goes away after training is
tests/system/test_tracking_server.py's.)"""

from __future__ import annotations

import io
import socket
import time
from pathlib import Path

import pytest
from rich.console import Console

from raytrain_ddp import ConfigError, load_config, run

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_tracking_server_is_refused_in_seconds_before_anything_starts(workspace, record):
    closed = f"http://127.0.0.1:{free_port()}"
    with socket.socket() as silent, socket.socket() as filler:
        # A listener whose queue is full drops new connections unanswered, as a firewall does.
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        filler.connect(silent.getsockname())
        firewalled = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for uri, reason in ((closed, "connection refused"), (firewalled, "no connection within 3 s")):
            config = load_config(TINY, overrides=workspace.overrides(f"mlflow.tracking_uri={uri}"))
            started = time.monotonic()
            with pytest.raises(ConfigError) as refused:
                run(config, console=Console(file=io.StringIO()))

            took = time.monotonic() - started
            assert took < 5
            assert f"mlflow.tracking_uri: the MLflow tracking server {uri} is unreachable ({reason})" in str(
                refused.value
            )
            record(
                f"MLflow tracking server unreachable: {reason}", attempts=0, versions=0, note=f"refused in {took:.1f} s"
            )
    assert not workspace.storage.exists()  # nothing written, nothing started
