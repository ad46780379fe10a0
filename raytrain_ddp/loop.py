"""The program every Ray Train worker runs: build, resume, train, evaluate, report; once per epoch.

`driver.run` starts it through TorchTrainer. Two names for the model: `model` is what we build, save
and evaluate; `ddp_model` is the DDP wrapper we train through. Every rank reports once per epoch
(`ray.train.report` is a barrier); only rank 0 writes the checkpoint. Metrics are global: sums and
counts are combined across ranks before anything is reported.
"""

from __future__ import annotations

import contextlib
import math
import random
import tempfile
import time
from typing import Any, Iterator

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp import data
from raytrain_ddp.config import Config, DDPSettings
from raytrain_ddp.metrics import EpochMeter, all_gather, combine
from raytrain_ddp.optim import Updater
from raytrain_ddp.recipe import Recipe


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    config = Config.from_dict(loop_config["config"])
    recipe: Recipe = loop_config["recipe"]
    rank = ray.train.get_context().get_world_rank()
    worker_data = data.WorkerData(loop_config["torch_datasets"], config.train, config.seed)
    device = worker_data.device

    # 1. Build the same model on every rank, wrap it in DDP, then optimizer, schedule and precision.
    torch.manual_seed(config.seed)
    model = recipe.build_model(**config.model)
    ddp_model = wrap_model(model, config.ddp)
    updater = Updater(model, ddp_model, config.train, loop_config["batches_per_epoch"], device)

    # 2. Resume from this run's latest checkpoint, or seed this rank's own random stream.
    start_epoch, step = 0, 0
    latest = ray.train.get_checkpoint()
    if latest is not None:
        with latest.as_directory() as directory:
            saved = ckpt.open_verified(directory)
            model.load_state_dict(saved.model_state())
            state = saved.training_state()
        updater.load_state_dict(state.updater)
        start_epoch, step = state.epoch, state.step
        if len(state.rng) != worker_data.world_size:
            raise RuntimeError(
                f"checkpoint was written by {len(state.rng)} workers, this run has {worker_data.world_size}; "
                f"resume with scaling.num_workers={len(state.rng)} or start a new run"
            )
        ckpt.set_rng_state(state.rng[rank])
    else:
        _seed_everything(data.derive_seed(config.seed, data.WORKER_RNG, rank))

    # 3. Train: one report per epoch from every rank, with rank 0's checkpoint.
    for epoch in range(start_epoch, config.train.epochs):
        started = time.perf_counter()
        meter = EpochMeter()
        ddp_model.train()
        for i, batch in enumerate(meter.timed(worker_data.train_batches(epoch))):
            with updater.sync(i), updater.autocast():
                loss = recipe.compute_loss(ddp_model, batch)
            updater.backward(loss, i)
            meter.add_batch(loss, _rows(batch), recipe.count_tokens(batch) if recipe.count_tokens else None)
            if updater.ready(i):
                meter.add_step(updater.step())
                step += 1
        if meter.batches != loop_config["batches_per_epoch"]:  # the accumulation groups assume the count
            raise RuntimeError(f"rank {rank} got {meter.batches} batches in epoch {epoch + 1}, expected {loop_config['batches_per_epoch']}")
        train = combine(meter, recipe.count_tokens is not None, device)
        if not math.isfinite(train["train_loss"]):
            raise FloatingPointError(f"training loss is {train['train_loss']} in epoch {epoch + 1}; lower train.lr?")

        with _rank0_buffers(model, keep_own=not config.ddp.broadcast_buffers), updater.autocast():
            val = evaluate(model, recipe, worker_data.val_batches())

        metrics = {
            "epoch": epoch + 1,
            "step": step,
            "lr": updater.lr,
            **train,
            **{f"val_{name}": value for name, value in val.items()},
            "epoch_time_s": time.perf_counter() - started,
        }
        _check_score(metrics, config.checkpoint.score_attribute)
        state = ckpt.TrainingState(epoch + 1, step, updater.state_dict(), rng=all_gather(ckpt.rng_state()))
        _report(metrics, model, state, loop_config["config"], rank)


def wrap_model(model: torch.nn.Module, ddp: DDPSettings) -> torch.nn.Module:
    """DDP with the configured keyword arguments (after SyncBatchNorm conversion, if asked for).
    `model` stays the unwrapped module: converted BatchNorm layers keep the same state_dict keys."""
    if ddp.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp.model_dump(exclude={"sync_batchnorm"}))


def evaluate(model: torch.nn.Module, recipe: Recipe, batches: Iterator[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Global validation: the mean of each recipe metric over all ranks' rows, plus `samples` (every
    validation row, each counted once across ranks) and `samples_per_worker`."""
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


def _report(metrics: dict[str, Any], model: torch.nn.Module, state: ckpt.TrainingState, config: dict, rank: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if rank == 0:
            ckpt.save(directory, model=model, state=state, config=config, metrics=metrics)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"epoch_{state.epoch:04d}")


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


def _check_score(metrics: dict[str, Any], score_attribute: str) -> None:
    # Ray ranks a report that lacks the score as best, which can delete the real best checkpoint.
    if score_attribute not in metrics:
        raise KeyError(
            f"checkpoint.score_attribute={score_attribute!r} is not a reported metric; "
            f"choose one of: {', '.join(sorted(metrics))}"
        )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return len(next(iter(batch.values())))
