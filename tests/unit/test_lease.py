"""One driver per run: the lease file, with real processes (alive, killed) as its holders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from raytrain_ddp.checkpoint import lease


def _write_holder(run_dir, *, pid: int, renewed_ago_s: float = 0.0, host: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    holder = {
        "owner": "someone-else",
        "host": host or socket.gethostname(),
        "pid": pid,
        "command": "raytrain-ddp train digits run.name=x",
        "started": now - 100,
        "renewed": now - renewed_ago_s,
    }
    (run_dir / lease.LEASE_FILE).write_text(json.dumps(holder))


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_run_held_by_a_live_driver_is_refused_naming_that_driver(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_holder(tmp_path / "x", pid=sleeper.pid, renewed_ago_s=5)
        before = (tmp_path / "x" / lease.LEASE_FILE).read_bytes()
        with pytest.raises(lease.RunBusy, match=rf"run x is being trained by another driver \(pid {sleeper.pid} on "):
            lease.check(str(tmp_path / "x"))
        with pytest.raises(lease.RunBusy, match="renewed 5 s ago: raytrain-ddp train digits run.name=x"):
            with lease.Lease(str(tmp_path / "x")):
                pass
        assert (tmp_path / "x" / lease.LEASE_FILE).read_bytes() == before  # refused, nothing written
    finally:
        sleeper.kill()


def test_the_lease_of_a_killed_driver_is_taken_over_at_once(tmp_path):
    _write_holder(tmp_path / "x", pid=_dead_pid())
    assert lease.check(str(tmp_path / "x")).alive() is False
    with lease.Lease(str(tmp_path / "x")) as held:
        on_disk = json.loads((tmp_path / "x" / lease.LEASE_FILE).read_text())
        assert on_disk["pid"] == os.getpid() and on_disk["owner"] == held.me.owner
    assert not (tmp_path / "x" / lease.LEASE_FILE).exists()  # let go


def test_a_lease_not_renewed_for_a_minute_is_stale_even_from_another_host(tmp_path):
    _write_holder(tmp_path / "x", pid=1, host="another-host", renewed_ago_s=lease.STALE_AFTER_S + 1)
    assert lease.check(str(tmp_path / "x")).alive() is False
    _write_holder(tmp_path / "x", pid=1, host="another-host", renewed_ago_s=1)
    with pytest.raises(lease.RunBusy, match="on another-host"):
        lease.check(str(tmp_path / "x"))


def test_a_new_run_has_no_lease_and_checking_writes_nothing(tmp_path):
    assert lease.check(str(tmp_path / "new")) is None
    assert not (tmp_path / "new").exists()


def test_the_holder_renews_its_lease_while_it_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_EVERY_S", 0.2)
    with lease.Lease(str(tmp_path / "x")):
        first = json.loads((tmp_path / "x" / lease.LEASE_FILE).read_text())["renewed"]
        time.sleep(0.7)
        later = json.loads((tmp_path / "x" / lease.LEASE_FILE).read_text())["renewed"]
    assert later > first
