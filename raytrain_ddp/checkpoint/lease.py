"""One driver per run: a lease file in the run's directory says which driver is training it.

    <storage_path>/<run name>/driver.json    {"owner", "host", "pid", "command", "started", "renewed"}

`check` only reads: a second driver on a run that a live driver holds is refused before it writes
anything. `Lease` takes the run for the length of training and renews the file every RENEW_EVERY_S
in the background. A lease whose driver is gone can be taken over: on the same host, as soon as its
process has exited (killed, say); from another host, once it has not been renewed for STALE_AFTER_S.
The storage may be a local or shared path or a URI (s3://...): the file goes through pyarrow.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from raytrain_ddp.checkpoint import storage

if TYPE_CHECKING:
    import pyarrow.fs

LEASE_FILE = "driver.json"
RENEW_EVERY_S = 10.0
STALE_AFTER_S = 60.0

logger = logging.getLogger(__name__)


class RunBusy(RuntimeError):
    """Another live driver is training this run."""


@dataclass(frozen=True)
class Holder:
    owner: str  # random per driver: tells two drivers with the same pid on two hosts apart
    host: str
    pid: int
    command: str
    started: float  # wall-clock seconds
    renewed: float

    def alive(self) -> bool:
        if time.time() - self.renewed > STALE_AFTER_S:
            return False  # killed on another host, hung, or its pid reused since
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process: it exists
            pass
        return True

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"pid {self.pid} on {self.host}, started {started}, renewed {time.time() - self.renewed:.0f} s ago: "
            f"{self.command}"
        )


def check(run_path: str) -> Holder | None:
    """Raise RunBusy if a live driver holds `run_path`; else return the last holder (stale, to be taken
    over) or None. Writes nothing."""
    return _check(*_locate(run_path))


class Lease:
    """`with Lease(run_path):` holds the run for this driver, renewing the lease until the block ends."""

    def __init__(self, run_path: str):
        self.fs, self.path = _locate(run_path)
        self.me = Holder(
            owner=secrets.token_hex(8),
            host=socket.gethostname(),
            pid=os.getpid(),
            command=" ".join(sys.argv),
            started=time.time(),
            renewed=time.time(),
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="raytrain-ddp-lease", daemon=True)

    def __enter__(self) -> Lease:
        _check(self.fs, self.path)
        self._write()
        _check(self.fs, self.path, me=self.me.owner)  # two drivers that both found the run free: the last write wins
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        holder = _read(self.fs, self.path)
        if holder is not None and holder.owner == self.me.owner:
            self.fs.delete_file(self.path)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_EVERY_S):
            try:
                holder = _read(self.fs, self.path)
                if holder is not None and holder.owner != self.me.owner:
                    logger.error("the run was taken over by another driver (%s); stop this one", holder.describe())
                    return
                self._write()
            except OSError as e:  # storage briefly unavailable: try again at the next renewal
                logger.warning("could not renew the run's lease: %s", e)

    def _write(self) -> None:
        self.me = Holder(**{**asdict(self.me), "renewed": time.time()})
        directory = self.path.rsplit("/", 1)[0]
        self.fs.create_dir(directory, recursive=True)
        staging = f"{self.path}.{self.me.owner}"  # written whole, then moved: readers never see half a file
        with self.fs.open_output_stream(staging) as f:
            f.write(json.dumps(asdict(self.me)).encode())
        self.fs.move(staging, self.path)


def _check(fs: pyarrow.fs.FileSystem, path: str, me: str | None = None) -> Holder | None:
    holder = _read(fs, path)
    if holder is not None and holder.owner != me and holder.alive():
        raise RunBusy(
            f"run {path.rsplit('/', 2)[-2]} is being trained by another driver ({holder.describe()}); "
            f"wait for it to finish, or choose another run.name"
        )
    return holder


def _locate(run_path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    fs, path = storage.locate(run_path)
    return fs, f"{path}/{LEASE_FILE}"


def _read(fs: pyarrow.fs.FileSystem, path: str) -> Holder | None:
    try:
        with fs.open_input_stream(path) as f:
            return Holder(**json.loads(f.read()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:  # not ours, or from another version: say so rather than guess
        raise RunBusy(
            f"{path} is not a lease this version can read ({e}); if no driver is training the run, delete it"
        ) from None
