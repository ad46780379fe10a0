"""`storage.upload`, on the local filesystem: a whole copy, or nothing of it. Transient errors come from
the local filesystem seen through a wrapper that answers S3's "SlowDown" to the first writes of each
file (the S3 of tests/system/test_s3.py does it over HTTP)."""

from __future__ import annotations

import errno

import fsspec.implementations.local
import pyarrow.fs
import pytest

from raytrain_ddp.checkpoint import storage

FILES = ("model.pt", "metrics.json", "manifest.json")


@pytest.fixture
def written(tmp_path):
    source = tmp_path / "local"
    source.mkdir()
    for i, name in enumerate(FILES):
        (source / name).write_bytes(bytes([i]) * (1000 + i))
    return source


def test_an_upload_copies_every_file(written, tmp_path):
    retried: list[str] = []
    storage.upload(str(written), pyarrow.fs.LocalFileSystem(), str(tmp_path / "run" / "epoch_0001"), FILES, 5, retried)

    for name in FILES:
        assert (tmp_path / "run" / "epoch_0001" / name).read_bytes() == (written / name).read_bytes()
    assert retried == []


def test_a_failed_upload_leaves_nothing_and_is_not_retried_unless_transient(written, tmp_path):
    (written / "metrics.json").unlink()  # fails after model.pt is written, before the manifest
    destination = tmp_path / "run" / "epoch_0001"
    retried: list[str] = []

    with pytest.raises(FileNotFoundError):
        storage.upload(str(written), pyarrow.fs.LocalFileSystem(), str(destination), FILES, 5, retried)

    assert not destination.exists() and retried == []


def test_errors_are_told_apart():
    throttled = OSError("When uploading part for key 'r/model.pt': AWS Error SLOW_DOWN during UploadPart operation")
    full = OSError(errno.ENOSPC, "No space left on device")
    assert storage.is_transient(throttled) and not storage.is_full(throttled)
    assert storage.is_full(full) and not storage.is_transient(full)
    assert storage.is_full(OSError("Error writing bytes to file. Detail: [errno 28] No space left on device"))


class Throttled(fsspec.implementations.local.LocalFileSystem):
    """The local filesystem, refusing the first `times` writes of each file as S3 does when throttling."""

    def __init__(self, times: int | None):
        super().__init__()
        self.times, self.refused = times, {}

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode or "a" in mode:
            refused = self.refused.get(path, 0)
            if self.times is None or refused < self.times:
                self.refused[path] = refused + 1
                raise OSError(f"When uploading key '{path}': AWS Error SLOW_DOWN during PutObject operation")
        return super()._open(path, mode, **kwargs)


def _throttled(times: int | None) -> pyarrow.fs.PyFileSystem:
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(Throttled(times)))


def test_transient_errors_are_retried_each_for_its_own_time_and_noted(written, tmp_path, monkeypatch):
    """Each file refused 3 times: 0.1 + 0.2 + 0.4 s of backoff, less than retry_s=1, though the three
    files fail for longer than that in all."""
    monkeypatch.setattr(storage, "FIRST_BACKOFF_S", 0.1)
    retried: list[str] = []
    storage.upload(str(written), _throttled(3), str(tmp_path / "run" / "epoch_0001"), FILES, 1.0, retried)

    for name in FILES:
        assert (tmp_path / "run" / "epoch_0001" / name).read_bytes() == (written / name).read_bytes()
    assert len(retried) == 9 and "AWS Error SLOW_DOWN" in retried[0]


def test_a_storage_that_stays_down_leaves_nothing(written, tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "FIRST_BACKOFF_S", 0.1)
    destination = tmp_path / "run" / "epoch_0001"
    retried: list[str] = []

    with pytest.raises(OSError, match="SLOW_DOWN"):
        storage.upload(str(written), _throttled(None), str(destination), FILES, 0.5, retried)

    assert not destination.exists() and 2 <= len(retried) <= 4
