"""A checkpoint saved and reported: rank 0 writes it and uploads it to the run's storage (sync), or Ray
does (async), each rank first uploading its own shards under FSDP2; every rank reports, the same
number of times, and learns from rank 0 how the upload went."""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from ray.train import CheckpointUploadMode

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.checkpoint import storage
from raytrain_ddp.config.schema import Config
from raytrain_ddp.worker import sharding
from raytrain_ddp.worker.metrics import (
    STOPPED,
    STORAGE_RETRIED,
    all_gather,
)
from raytrain_ddp.worker.timeline import strip as strip_marks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Blocked:
    """How long the previous checkpoint blocked training. Reported with the next."""

    checkpoint_s: float = 0.0


def save_and_report(
    metrics: dict[str, Any],
    model: torch.nn.Module,
    state: ckpt.TrainingState,
    config: Config,
    rank: int,
    name: str,
    retries: StorageRetries,
    sharded_optimizer: torch.optim.Optimizer | None = None,
) -> Blocked | None:
    """Report with the checkpoint of where training stands. Returns how long training was blocked, or
    None when the checkpoint could not be written and the run must stop (every rank then reports why).

    Rank 0 writes the checkpoint to a local directory, and `storage.upload` copies it to the run's
    directory, the manifest last, retrying transient storage errors (checkpoint.upload_retry_s); one
    that is not transient, or lasts, leaves nothing of it that looks like a checkpoint. Sharded
    (`sharded_optimizer`: FSDP2), every rank first writes and uploads its own shards (`_upload_shards`).
    sync: the upload ends before the report, so the report returns once the checkpoint is whole on
    storage. Training goes on without waiting for Ray's controller to record it: a worker that dies
    before it does leaves the checkpoint on storage, where the restart finds it (`_resume`). Every rank
    learns from rank 0 how the upload went: a storage that stays down, is full or refuses this writer
    stops the run (a restart would train again to the same failed write), any other error fails the
    attempt on every rank (Ray restarts it, within run.max_failures). async (DDP only): Ray uploads it
    in a background thread; training goes on at once, and a failure before the upload ends (a failed
    upload too) fails the attempt, which resumes from the checkpoint before."""
    started = time.perf_counter()
    shards, failed = {}, None
    if sharded_optimizer is not None:
        shards, failed = _upload_shards(model, sharded_optimizer, config, name, retries)
    local, files = None, ckpt.FILES
    if rank == 0 and failed is None:
        local = tempfile.mkdtemp(prefix=f"raytrain_ddp-{name}-")
        files = ckpt.save(
            local,
            model=None if sharded_optimizer is not None else model,
            state=state,
            config=config.to_dict(),
            metrics=strip_marks(metrics),
            shards=shards,
        )
    if config.checkpoint.upload == "async":
        ray.train.report(
            metrics | retries.pop(),
            checkpoint=None if local is None else ray.train.Checkpoint.from_directory(local),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=True,
            checkpoint_upload_fn=lambda checkpoint, _name: _upload(
                checkpoint.path, name, files, config, retries, by_ray=True
            ),
        )
        return Blocked(checkpoint_s=time.perf_counter() - started)
    uploaded = None
    if local is not None:
        try:
            uploaded = _upload(local, name, files, config, retries)
        except OSError as e:
            failed = _upload_failed(name, config, e)
    stops, problem = all_gather(failed)[0] or (False, None)  # rank 0's
    if problem is not None and not stops:
        raise RuntimeError(problem)
    if problem is not None:
        ray.train.report({**metrics, STOPPED: problem})
        return None
    ray.train.report(
        metrics | retries.pop(),
        checkpoint=uploaded,
        checkpoint_dir_name=name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,  # on storage already
    )
    return Blocked(checkpoint_s=time.perf_counter() - started)


def _upload_shards(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Config, name: str, retries: StorageRetries
) -> tuple[dict[str, dict[str, Any]], tuple[bool, str] | None]:
    """Every rank writes its shards of the model and optimizer state (DCP, collectively) and uploads
    them into the checkpoint's directory on storage. Returns every rank's shards with their digests,
    for rank 0's manifest, and the first rank's upload failure, if any (the same on every rank)."""
    local = Path(tempfile.mkdtemp(prefix=f"raytrain_ddp-{name}-shards-"))
    digests, failed = {}, None
    try:
        written = sharding.save(local, model, optimizer)
        digests = ckpt.digests(local, written)
        _upload(str(local), name, written, config, retries, within=ckpt.SHARDS_DIR)
    except OSError as e:
        failed = _upload_failed(name, config, e)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    parts = all_gather((digests if failed is None else {}, failed))
    failed = next((f for _, f in parts if f is not None), None)
    return {shard: digest for own, _ in parts for shard, digest in own.items()}, failed


class StorageRetries:
    """Rank 0's storage errors retried since its last report, for the console to warn of. A queue:
    with checkpoint.upload=async, Ray's upload thread notes them while training goes on."""

    def __init__(self):
        self._noted: queue.SimpleQueue[str] = queue.SimpleQueue()

    def note(self, name: str, retried: list[str]) -> None:
        if retried:
            self._noted.put(f"{name}: {len(retried)} × {retried[-1]}")

    def pop(self) -> dict[str, str]:
        """The retries noted since the last report, as the report carries them (nothing if none)."""
        said = []
        while not self._noted.empty():
            said.append(self._noted.get())
        return {STORAGE_RETRIED: f"transient storage errors retried: {'; '.join(said)}"} if said else {}


def _upload(
    local: str,
    name: str,
    files: Sequence[str],
    config: Config,
    retries: StorageRetries,
    by_ray: bool = False,
    within: str = "",
) -> ray.train.Checkpoint:
    """Copy `files` of the checkpoint written in `local` to the run's directory on storage, as `name`
    (into its subdirectory `within`: a rank's shards), then remove `local`. `by_ray`: the upload is
    Ray's (async), which removes `local` once it succeeds and may call again after a transient error,
    so `local` stays until then."""
    run_storage = ray.train.get_context().get_storage()
    fs, where = run_storage.storage_filesystem, run_storage.build_checkpoint_path_from_name(name)
    where = f"{where}/{within}" if within else where
    retried: list[str] = []
    try:
        run_storage._check_validation_file()  # as Ray's own upload does: this node sees the run's storage
        storage.upload(local, fs, where, files, config.checkpoint.upload_retry_s, retried)
    except OSError as e:
        if by_ray and not storage.is_transient(e):  # Ray will not call again
            shutil.rmtree(local, ignore_errors=True)
        raise
    finally:
        if not by_ray:
            shutil.rmtree(local, ignore_errors=True)
        retries.note(name, retried)
    return ray.train.Checkpoint(where, filesystem=fs)


def _upload_failed(name: str, config: Config, error: OSError) -> tuple[bool, str]:
    """Whether the run stops, and why: its checkpoint `name` could not be written to storage."""
    destination = f"{config.run.path}/{name}"
    stops = True
    if storage.is_full(error):
        fix = "the storage is full: free space there (or point run.storage_path elsewhere), then resume"
    elif storage.is_refused(error):
        fix = "this writer may not write there: fix the storage's permissions or credentials, then resume"
    elif storage.is_transient(error):
        fix = (
            f"the storage kept failing for checkpoint.upload_retry_s={config.checkpoint.upload_retry_s:g} s: "
            "resume once it answers again"
        )
    else:
        stops, fix = False, f"the attempt fails (run.max_failures={config.run.max_failures} restarts)"
    return stops, (
        f"checkpoint {name} could not be written to {destination} ({type(error).__name__}: {error}); nothing of "
        f"it is a resume point and the run's earlier checkpoints are untouched; {fix}"
    )
