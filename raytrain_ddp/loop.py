"""The program every Ray Train worker runs: build, resume, train, evaluate, report.

`driver.run` starts it through TorchTrainer. Two names for the model: `model` is what we build, save
and evaluate; `ddp_model` is the DDP wrapper we train through. Every rank reports at the end of each
epoch and every `checkpoint.every_n_steps` steps (`ray.train.report` is a barrier); only rank 0 writes
the checkpoint. Metrics are global: sums and counts are combined across ranks before anything is
reported, so every rank takes the same decisions, stopping included.

Resume is exact: an epoch's data order is a function of (seed, epoch), a checkpoint holds every
rank's random state and the micro-batch training stopped at, and a resumed epoch skips the batches
already trained. Restarted after a failure, the result equals that of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import CheckpointConsistencyMode, CheckpointUploadMode

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp import data
from raytrain_ddp.config import Config, DDPSettings
from raytrain_ddp.metrics import STOPPED, EpochMeter, all_gather, combine
from raytrain_ddp.optim import Updater
from raytrain_ddp.recipe import Recipe

logger = logging.getLogger(__name__)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    config = Config.from_dict(loop_config["config"])
    recipe: Recipe = loop_config["recipe"]
    batches_per_epoch: int = loop_config["batches_per_epoch"]
    rank = ray.train.get_context().get_world_rank()
    worker_data = data.WorkerData(loop_config["torch_datasets"], config.train, config.seed)
    device = worker_data.device

    # 1. Build the same model on every rank, wrap it in DDP, then optimizer, schedule and precision.
    torch.manual_seed(config.seed)
    model = recipe.build_model(**config.model)
    ddp_model = wrap_model(model, config.ddp)
    updater = Updater(model, ddp_model, config.train, batches_per_epoch, device)

    # 2. Resume where the newest checkpoint that verifies left off (to the micro-batch, with every
    #    rank's random state), or seed this rank's own random stream.
    start, retrained = _resume(model, updater, worker_data.world_size)
    if start is not None:
        ckpt.set_rng_state(start.rng[rank])
    else:
        start = ckpt.TrainingState(epoch=0, step=0, updater={}, rng=[])
        _seed_everything(data.derive_seed(config.seed, data.WORKER_RNG, rank))
    step = start.step
    blocked = {"checkpoint_s": 0.0, "commit_wait_s": 0.0}  # by the previous checkpoint, reported with the next

    def report(epoch: int, batches: int, meter: EpochMeter) -> bool:
        """Evaluate and report global metrics from every rank, with rank 0's checkpoint of where training
        stands: `epoch` epochs done and `batches` micro-batches into the next. False: stop the run."""
        with meter.paused(), _rank0_buffers(model, keep_own=not config.ddp.broadcast_buffers), updater.autocast():
            metrics = {
                "epoch": epoch + batches / batches_per_epoch,
                "step": step,
                "lr": updater.lr,
                **combine(meter, recipe.count_tokens is not None, device),
                **{f"val_{name}": value for name, value in evaluate(model, recipe, worker_data.val_batches()).items()},
                "epoch_time_s": meter.epoch_time_s(),
                **blocked,
            }
            problem = _stop_reason(metrics, config.checkpoint.score_attribute)
            if problem is not None:  # the same global metrics on every rank: every rank stops here
                ray.train.report({**metrics, STOPPED: problem})
                return False
            rng, meters = zip(*all_gather((ckpt.rng_state(), meter.state_dict() if batches else None)))
            state = ckpt.TrainingState(
                epoch, step, updater.state_dict(), list(rng), batches, list(meters) if batches else []
            )
            name = ckpt.dir_name(epoch, step, batches)
            name = name if name not in retrained else f"{name}-retrained"
            blocked.update(_report(metrics, model, state, loop_config["config"], rank, name, config.checkpoint.upload))
        return True

    # 3. Train. Report every checkpoint.every_n_steps optimizer steps and at the end of each epoch.
    every = config.checkpoint.every_n_steps
    for epoch in range(start.epoch, config.train.epochs):
        resumed = epoch == start.epoch and start.batches > 0
        meter = EpochMeter(**start.meters[rank]) if resumed else EpochMeter()
        first = start.batches if resumed else 0  # a resumed epoch skips the batches it already trained
        ddp_model.train()
        batches = itertools.islice(worker_data.train_batches(epoch), first, None)
        for i, batch in enumerate(meter.timed(batches), start=first):
            with updater.sync(i), updater.autocast():
                loss = recipe.compute_loss(ddp_model, batch)
            updater.backward(loss, i)
            meter.add_batch(loss, _rows(batch), recipe.count_tokens(batch) if recipe.count_tokens else None)
            if updater.ready(i):
                meter.add_step(updater.step())
                step += 1
                if every and step % every == 0 and i + 1 < batches_per_epoch:
                    if not report(epoch, i + 1, meter):
                        return
                    ddp_model.train()
        if meter.batches != batches_per_epoch:  # the accumulation groups assume the count
            raise RuntimeError(
                f"rank {rank} got {meter.batches} batches in epoch {epoch + 1}, expected {batches_per_epoch}"
            )
        if not report(epoch + 1, 0, meter):
            return


def wrap_model(model: torch.nn.Module, ddp: DDPSettings) -> torch.nn.Module:
    """DDP with the configured keyword arguments (after SyncBatchNorm conversion, if asked for).
    `model` stays the unwrapped module: converted BatchNorm layers keep the same state_dict keys."""
    if ddp.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp.model_dump(exclude={"sync_batchnorm"}))


def evaluate(model: torch.nn.Module, recipe: Recipe, batches: Iterator[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Global validation: the mean of each recipe metric over all ranks' rows, plus `samples` (every
    validation row, each counted once across ranks) and `samples_per_worker`. Leaves `model` in eval
    mode."""
    model.eval()
    rows, sums = 0, {}
    with torch.no_grad():
        for batch in batches:
            for name, (total, count) in recipe.evaluate(model, batch).items():
                s, n = sums.get(name, (0.0, 0))
                sums[name] = (s + float(total), n + int(count))
            rows += _rows(batch)
    parts = all_gather((rows, sums))  # a rank that saw no batch still takes part
    metrics: dict[str, Any] = {"samples": sum(r for r, _ in parts), "samples_per_worker": [r for r, _ in parts]}
    for name in sorted({name for _, part in parts for name in part}):
        total = sum(part[name][0] for _, part in parts if name in part)
        count = sum(part[name][1] for _, part in parts if name in part)
        metrics[name] = total / max(count, 1)
    return metrics


def _resume(model: torch.nn.Module, updater: Updater, world_size: int) -> tuple[ckpt.TrainingState | None, set[str]]:
    """Load the newest checkpoint of the run that verifies: Ray's latest, else (damaged) the newest
    committed one before it. Returns its training state (None for a new run) and the names of the
    checkpoints skipped, which training will pass again and must not overwrite."""
    latest = ray.train.get_checkpoint()
    if latest is None:
        return None, set()
    reported = ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    older = [c for c in ckpt.newest_first((r.checkpoint, r.metrics) for r in reported) if c.path != latest.path]
    with ckpt.open_first_verified([latest, *older]) as opened:
        for skipped in opened.skipped:
            logger.warning("skipping a damaged checkpoint: %s", skipped)
        chosen = all_gather(opened.name)
        if len(set(chosen)) != 1:
            raise ckpt.CheckpointError(
                f"the ranks found different checkpoints valid ({chosen}): is the storage shared?"
            )
        model.load_state_dict(opened.verified.model_state())
        state = opened.verified.training_state()
    if len(state.rng) != world_size:
        raise RuntimeError(
            f"checkpoint was written by {len(state.rng)} workers, this run has {world_size}; "
            f"resume with scaling.num_workers={len(state.rng)} or start a new run"
        )
    updater.load_state_dict(state.updater)
    return state, {skipped.name for skipped in opened.skipped}


def _report(
    metrics: dict[str, Any],
    model: torch.nn.Module,
    state: ckpt.TrainingState,
    config: dict,
    rank: int,
    name: str,
    upload: str,
) -> dict[str, float]:
    """Report with rank 0's checkpoint. Returns the seconds training was blocked, in all and waiting
    for the commit.

    sync: upload, then wait until the controller has committed the checkpoint: a worker that died in
    the next second would otherwise take it with it (the restart would resume from the one before).
    async: rank 0 writes the checkpoint to a local directory and Ray uploads it (then deletes it) in
    a background thread; training goes on at once, and a failure before the commit resumes from the
    checkpoint before (the result is the same, the work since is lost)."""
    started = time.perf_counter()
    mode = CheckpointUploadMode.ASYNC if upload == "async" else CheckpointUploadMode.SYNC
    checkpoint = None
    if rank == 0:  # a local directory, which Ray deletes once it has uploaded it
        directory = tempfile.mkdtemp(prefix=f"raytrain_ddp-{name}-")
        ckpt.save(directory, model=model, state=state, config=config, metrics=metrics)
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report(
        metrics,
        checkpoint=checkpoint,
        checkpoint_dir_name=name,
        checkpoint_upload_mode=mode,
        delete_local_checkpoint_after_upload=True,
    )
    reported = time.perf_counter()
    if mode == CheckpointUploadMode.SYNC:
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    done = time.perf_counter()
    return {"checkpoint_s": done - started, "commit_wait_s": done - reported}


@contextlib.contextmanager
def _rank0_buffers(model: torch.nn.Module, keep_own: bool) -> Iterator[None]:
    """Evaluate with rank 0's buffers (BatchNorm statistics): the model that rank 0 checkpoints.

    With `broadcast_buffers` DDP would copy them at the next forward anyway; without it each rank
    gets its own back afterwards."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    own = [b.detach().clone() for b in model.buffers()] if keep_own else []
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    try:
        yield
    finally:
        for buffer, saved in zip(model.buffers(), own):
            buffer.copy_(saved)


def _stop_reason(metrics: dict[str, Any], score: str) -> str | None:
    """Why the run cannot go on, if it cannot: retrying would only repeat it. A report without the
    score would be ranked best by Ray, which could then delete the real best checkpoint."""
    where = f"at step {metrics['step']} (epoch {metrics['epoch']:.4g})"
    if not math.isfinite(metrics["train_loss"]):
        loss = metrics["train_loss"]
        return f"training diverged: the training loss is {loss} {where}; lower train.lr or set train.grad_clip_norm"
    if score not in metrics:
        missing = score.removeprefix("val_")
        return (
            f"checkpoint.score_attribute {score!r} is missing from the report {where}; "
            f"the recipe's evaluate returned no {missing!r}"
        )
    if not math.isfinite(metrics[score]):
        return f"the score {score} is {metrics[score]} {where}: a checkpoint cannot be ranked by it"
    return None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return len(next(iter(batch.values())))
