"""`storage.upload`, on the local filesystem: a whole copy, or nothing of it."""

from __future__ import annotations

import errno

import pyarrow.fs
import pytest

from raytrain_ddp import storage

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
