"""A wrong RAY_ADDRESS is refused in seconds, before torch or Ray load or anything is written; a
dashboard address is joined at its cluster's GCS port where that answers. (Ray itself waits for
minutes on an address where nothing answers, and answers a dashboard address with a traceback.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ddp.cluster.ray_address import check

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(cwd: Path, ray_address: str) -> tuple[subprocess.CompletedProcess, float]:
    """`raytrain-ddp train tiny.py` in a fresh process, as a user runs it."""
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp.cli", "train", TINY],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result, time.monotonic() - started


def test_a_gcs_address_where_nothing_answers_is_refused_in_seconds(tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    result, took = _train(tmp_path, address)

    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: invalid configuration for job")
    assert f"RAY_ADDRESS={address}: no Ray cluster answers there (connection refused)" in result.stderr
    assert "or unset RAY_ADDRESS to start a local Ray" in result.stderr
    assert took < 15
    assert list(tmp_path.iterdir()) == []  # no runs/, no mlflow.db


def test_a_dashboard_address_is_refused_with_the_addresses_to_use(tmp_path):
    with socket.socket() as probe:  # the test needs a host whose default GCS port is closed: not skipped
        assert probe.connect_ex(("127.0.0.1", 6379)) != 0, "stop the Ray listening at 127.0.0.1:6379 to run this"
    address = f"http://127.0.0.1:{closed_port()}"
    result, took = _train(tmp_path, address)

    assert result.returncode == 2, result.stderr[-2000:]
    assert f"RAY_ADDRESS={address} is a dashboard address, which `ray job submit` takes" in result.stderr
    assert "nothing answers at the GCS address 127.0.0.1:6379" in result.stderr
    assert "ray job submit --address http://<head>:8265 --working-dir . -- raytrain-ddp train" in result.stderr
    assert "Traceback" not in result.stderr
    assert took < 15
    assert list(tmp_path.iterdir()) == []


def test_a_dashboard_address_is_joined_at_the_gcs_port_of_its_host_when_that_answers():
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        port = gcs.getsockname()[1]
        address = check("http://127.0.0.1:8265", gcs_port=port)

    assert address.problem is None
    assert address.join == f"127.0.0.1:{port}"
    assert f"joining the cluster at its GCS address 127.0.0.1:{port}" in address.note


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("ray://127.0.0.1:10001", "Ray Client (ray://) is not supported"),
        ("head-node", "expected host:port (the cluster's GCS address"),
    ],
)
def test_other_addresses_say_what_to_use(value, expected):
    address = check(value)
    assert address.join is None and expected in address.problem
    assert "ray job submit" in address.problem or "unset it to start a local Ray" in address.problem


def test_local_and_auto_are_rays():
    assert check("") == check("local") == check("  ")
    assert check("").join is None and check("").problem is None
    assert check("auto").join == "auto"


def test_from_python_a_wrong_address_is_refused_before_anything_is_written(workspace):
    # In a process of its own: one that has a Ray already (the system tier's) uses it, whatever RAY_ADDRESS says.
    address = f"127.0.0.1:{closed_port()}"
    script = f"""
import io, sys, time
from rich.console import Console
from raytrain_ddp import ConfigError, load_config, run
config = load_config({TINY!r}, overrides={workspace.overrides()!r})
started = time.monotonic()
try:
    run(config, console=Console(file=io.StringIO()))
except ConfigError as e:
    print(f"{{time.monotonic() - started:.1f}}", e)
"""
    env = {**os.environ, "RAY_ADDRESS": address}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    seconds, message = result.stdout.split(" ", 1)
    assert f"RAY_ADDRESS={address}: no Ray cluster answers there" in message, result.stdout + result.stderr
    assert float(seconds) < 10
    assert workspace.untouched()
