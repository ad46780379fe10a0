"""Batch arithmetic before any worker starts: every rank gets whole batches, a resumed run's optimizer
steps still add up, and batches grouped by length can be."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raytrain_ddp.config.schema import Config, worker_counts
from raytrain_ddp.data import datasets as data
from raytrain_ddp.data.stream import Blocks
from raytrain_ddp.worker.optim import batches_per_epoch, optimizer_steps


def check_batches(config: Config, train_rows: int) -> list[str]:
    """Batch arithmetic per worker, on each number of workers the run may have (the most first: the
    fewest rows each): an epoch of no step is refused, a batch larger than a worker's share of the
    rows is named (each epoch would be one short step)."""
    for workers in reversed(worker_counts(config.scaling.num_workers)):
        if problems := _batches_on(config, train_rows, workers):
            return problems
    return []


def _batches_on(config: Config, train_rows: int, workers: int) -> list[str]:
    t, accumulation = config.train, config.accumulation_on(workers)
    rows = train_rows // workers
    batches = batches_per_epoch(train_rows, workers, t.batch_size, t.drop_last)
    share = f"{train_rows} training rows over {workers} workers are {rows} per worker"
    if batches == 0:
        return [
            f"train.batch_size: {share}, fewer than one batch of {t.batch_size}"
            + (" with train.drop_last=true" if t.drop_last else "")
            + f": an epoch would train nothing; use train.batch_size <= {max(rows, 1)} or fewer workers"
        ]
    problems = []
    if t.batch_size > rows:
        problems.append(
            f"train.batch_size: {share}, fewer than one batch of {t.batch_size}: each epoch would be one short "
            f"step of {rows} rows per worker; use train.batch_size <= {rows}"
        )
    if accumulation > batches:
        s = config.scaling
        per_step = (
            f"{t.grad_accum_steps} on {s.max_workers} workers, {accumulation} micro-batches per step on {workers}"
            if s.elastic
            else f"{accumulation} micro-batches per step"
        )
        problems.append(
            f"train.grad_accum_steps: {per_step}, but each worker has {batches} batch(es) of {t.batch_size} an "
            f"epoch; lower it to <= {batches * workers // s.max_workers} or the batch size"
        )
    return problems


def check_steps(config: Config, saved: Mapping[str, Any] | None, train_rows: int) -> list[str]:
    """Every number of workers a run may train on (each of an elastic range, and the one it ran on
    before a resume: `_resized`) must make the same optimizer steps an epoch, or the learning-rate
    schedule and the step count would depend on it: how the rows round into batches may differ."""
    t, s = config.train, config.scaling

    def steps(workers: int, per_step: int) -> int:
        return optimizer_steps(batches_per_epoch(train_rows, workers, t.batch_size, t.drop_last), per_step // workers)

    per_step = config.micro_batches_per_step
    made = {workers: steps(workers, per_step) for workers in worker_counts(s.num_workers)}  # one count, or each
    if len(set(made.values())) > 1:
        shown = ", ".join(f"{n} on {w} × {per_step // w}" for w, n in made.items())
        fix = "set train.drop_last=true or a" if not t.drop_last else "choose a"
        return [
            f"scaling.num_workers={list(s.num_workers)}: {train_rows} training rows make a different number of "
            f"optimizer steps an epoch on each count of workers ({shown} micro-batches a step): the learning-rate "
            f"schedule would depend on it; {fix} train.batch_size that splits the rows the same way on each"
        ]
    if saved is None:
        return []
    was = (max(worker_counts(saved["scaling"]["num_workers"])), saved["train"].get("grad_accum_steps", 1))
    made_before = steps(was[0], was[0] * was[1])
    if made_before == made[s.max_workers]:
        return []
    return [
        f"scaling.num_workers: {train_rows} training rows make {made[s.max_workers]} optimizer steps an epoch on "
        f"{s.max_workers} workers × train.grad_accum_steps {t.grad_accum_steps}, the run made {made_before} on "
        f"{was[0]} × {was[1]}: its learning-rate schedule would shift; resume on a number of workers that splits "
        "the rows the same way"
    ]


def check_group_by_length(config: Config, datasets: Mapping[str, Any], example: Mapping[str, Any]) -> list[str]:
    """train.group_by_length names a column of whole numbers that the rows have, of datasets each rank
    reads itself (a stream's files, a materialized Ray Dataset's blocks): where Ray Train's Ray Data
    path or a DataLoader reads them, batches are not formed here."""
    column = config.train.group_by_length
    if column is None:
        return []
    if not (data.is_stream(datasets) or (data.is_ray(datasets) and Blocks.of(datasets["train"]) is not None)):
        return [
            f"train.group_by_length: batches are grouped by length from streams and materialized Ray Datasets, "
            f"not from this job's {type(datasets['train']).__name__}: materialize it in build_datasets, or set "
            "train.group_by_length=null"
        ]
    if column not in example:
        return [
            f"train.group_by_length: the rows have no column {column!r} (they have {', '.join(sorted(example))}); "
            "name the column of each row's length"
        ]
    values = example[column]
    if getattr(values, "ndim", None) != 1 or values.dtype.is_floating_point or values.dtype.is_complex:
        return [f"train.group_by_length: column {column!r} is not one whole number a row (a length)"]
    return []
