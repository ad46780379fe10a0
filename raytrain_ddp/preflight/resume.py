"""What a resumed run may not change against the config its checkpoint was written with, and the one
exception: the number of workers, at an epoch's end, keeping the global batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from raytrain_ddp.config.schema import Config, flatten, worker_counts

# Keys a resumed run may change: they do not change what is computed, only how long, where, and what
# is kept or logged. Anything else would be silently overridden by the restored optimizer state or
# break exact resume, so changing it means starting a new run. The number of workers is the one
# exception, with its own rule (`_resized`): it may change at an epoch's end, keeping the global batch.
RESUMABLE = (
    "train.epochs",
    "train.early_stopping.",
    "train.eval_batch_size",
    "train.num_loader_workers",
    "scaling.use_gpu",
    "scaling.resize_check_s",
    "scaling.resources_per_worker",
    "data.",
    "ddp.bucket_cap_mb",
    "ddp.gradient_as_bucket_view",
    "ddp.find_unused_parameters",
    "ddp.static_graph",
    "fsdp.reshard_after_forward",
    "checkpoint.",
    "run.storage_path",
    "run.max_failures",
    "run.controller_poll_s",
    "run.resources_wait_s",
    "run.prestart_workers",
    "run.progress_",
    "mlflow.",
    "sweep.",
)


def resume_conflicts(saved: Mapping[str, Any], config: Config) -> list[str]:
    """What `config` changes, against the config saved in the checkpoint the run resumes from, that a
    resume may not change; one line per key."""
    before = {".".join(path): value for path, value in flatten(saved).items()}
    after = config.flat()
    # A key the saved config lacks was added to the schema after the run started, which then
    # trained as its default says (train.compile: false).
    defaults = Config(job=config.job).flat()
    was = {key: before.get(key, defaults.get(key)) for key in set(before) | set(after)}
    resizing = ("scaling.num_workers", "train.grad_accum_steps")
    return _resized(*(was[key] for key in resizing), config) + [
        f"{key}: was {was[key]!r} when the run started, now {after.get(key)!r}; a resumed run keeps it"
        for key in sorted(was)
        if was[key] != after.get(key) and not key.startswith(RESUMABLE) and key not in resizing
    ]


def _resized(workers: int | Sequence[int], accumulation: int, config: Config) -> list[str]:
    """A run may resume on another number of workers, or range of them, keeping its global batch
    (batch_size × max workers × grad_accum_steps rows a step): the same optimizer steps an epoch, the
    same schedule, and each rank's share of an epoch drawn afresh from (seed, epoch). It resumes at an
    epoch's end: a mid-epoch position names what each of the old ranks had read
    (`checkpoint.resumable_on`). An elastic run resizes by the same rule (`Config.accumulation_on`)."""
    per_step = max(worker_counts(workers)) * accumulation
    if config.micro_batches_per_step == per_step:
        return []
    most, at_most = config.scaling.max_workers, " at most" if config.scaling.elastic else ""
    fix = (
        f"with {most} workers{at_most} set train.grad_accum_steps={per_step // most}"
        if per_step % most == 0
        else f"use a number of workers that divides {per_step}"
    )
    was = f"{_counted(workers)} × train.grad_accum_steps {accumulation}"
    now = f"{_counted(config.scaling.num_workers)} × train.grad_accum_steps {config.train.grad_accum_steps}"
    return [
        f"scaling.num_workers: the run steps on {per_step} micro-batches of train.batch_size ({was}); "
        f"{now} would change its global batch: {fix}"
    ]


def _counted(workers: int | Sequence[int]) -> str:
    return f"{workers} workers" if isinstance(workers, int) else f"{workers[0]}–{workers[1]} workers"
