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
from typing import Any, Iterable, Iterator

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp import data
from raytrain_ddp.config import Config, TrainSettings
from raytrain_ddp.recipe import Recipe


# What every report carries besides the recipe's `val_<name>` metrics.
TRAIN_METRICS = (
    "epoch", "step", "lr", "train_loss", "train_rows", "train_rows_per_worker", "train_batches", "epoch_time_s",
)


def reported_metrics(val_names: Iterable[str]) -> set[str]:
    """The keys of every report, given the names the recipe's `evaluate` returns."""
    return {*TRAIN_METRICS, "val_rows", "val_rows_per_worker", *(f"val_{name}" for name in val_names)}


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    config = Config.from_dict(loop_config["config"])
    recipe: Recipe = loop_config["recipe"]
    steps_per_epoch: int = loop_config["steps_per_epoch"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()

    # 1. Build the same model on every rank, wrap it in DDP, then the optimizer and LR schedule.
    torch.manual_seed(config.seed)
    model = recipe.build_model(**config.model)
    ddp_model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=config.ddp.model_dump())
    optimizer = _optimizer(model, config.train)
    scheduler = _lr_schedule(optimizer, config.train, steps_per_epoch)

    # 2. Resume from this run's latest checkpoint, or seed this rank's own random stream.
    start_epoch, step = 0, 0
    latest = ray.train.get_checkpoint()
    if latest is not None:
        with latest.as_directory() as directory:
            saved = ckpt.open_verified(directory)
            model.load_state_dict(saved.model_state())
            state = saved.training_state()
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        start_epoch, step = state.epoch, state.step
        if len(state.rng) != world_size:
            raise RuntimeError(
                f"checkpoint was written by {len(state.rng)} workers, this run has {world_size}; "
                f"resume with scaling.num_workers={len(state.rng)} or start a new run"
            )
        ckpt.set_rng_state(state.rng[rank])
    else:
        _seed_everything(data.derive_seed(config.seed, data.WORKER_RNG, rank))

    # 3. Train: one report per epoch from every rank, with rank 0's checkpoint.
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    for epoch in range(start_epoch, config.train.epochs):
        started = time.perf_counter()
        batches = data.train_batches(
            train_shard,
            batch_size=config.train.batch_size,
            drop_last=config.train.drop_last,
            shuffle_buffer=config.train.local_shuffle_buffer_size,
            seed=config.seed,
            epoch=epoch,
            rank=rank,
            device=device,
        )
        ddp_model.train()
        loss_sum, rows, batch_count = 0.0, 0, 0
        for batch in batches:
            loss = recipe.compute_loss(ddp_model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            loss_sum += loss.detach() * _rows(batch)
            rows += _rows(batch)
            batch_count += 1
        train = _all_gather({"loss": float(loss_sum), "rows": rows, "batches": batch_count})
        train_loss = sum(p["loss"] for p in train) / max(sum(p["rows"] for p in train), 1)
        if not math.isfinite(train_loss):
            raise FloatingPointError(f"training loss is {train_loss} in epoch {epoch + 1}; lower train.lr?")

        with _rank0_buffers(model, keep_own=not config.ddp.broadcast_buffers):
            val = evaluate(model, recipe, val_shard, config.train.eval_batch_size, rank, world_size, device)

        metrics = {
            "epoch": epoch + 1,
            "step": step,
            "lr": scheduler.get_last_lr()[0],
            "train_loss": train_loss,
            "train_rows": sum(p["rows"] for p in train),
            "train_rows_per_worker": [p["rows"] for p in train],
            "train_batches": sum(p["batches"] for p in train),
            **{f"val_{name}": value for name, value in val.items()},
            "epoch_time_s": time.perf_counter() - started,
        }
        _check_score(metrics, config.checkpoint.score_attribute)
        _report(metrics, model, optimizer, scheduler, step, loop_config["config"], rank, epoch)


def evaluate(
    model: torch.nn.Module,
    recipe: Recipe,
    shard: ray.data.DataIterator,
    batch_size: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """Global validation: the mean of each recipe metric over all ranks' rows, plus `rows` (every
    validation row, each counted once across ranks) and `rows_per_worker`."""
    model.eval()
    rows, sums = 0, {}
    with torch.no_grad():
        for batch in data.val_batches(shard, batch_size=batch_size, rank=rank, world_size=world_size, device=device):
            for name, (total, count) in recipe.evaluate(model, batch).items():
                s, n = sums.get(name, (0.0, 0))
                sums[name] = (s + float(total), n + int(count))
            rows += _rows(batch)
    parts = _all_gather((rows, sums))  # a rank that saw no batch still takes part
    metrics: dict[str, Any] = {"rows": sum(r for r, _ in parts), "rows_per_worker": [r for r, _ in parts]}
    for name in sorted({name for _, part in parts for name in part}):
        total = sum(part[name][0] for _, part in parts if name in part)
        count = sum(part[name][1] for _, part in parts if name in part)
        metrics[name] = total / max(count, 1)
    return metrics


def _report(metrics, model, optimizer, scheduler, step, config_dict, rank, epoch) -> None:
    rng = _all_gather(ckpt.rng_state())  # every rank's stream, so a resume continues each one
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if rank == 0:
            state = ckpt.TrainingState(epoch + 1, step, optimizer.state_dict(), scheduler.state_dict(), rng)
            ckpt.save(directory, model=model, state=state, config=config_dict, metrics=metrics)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"epoch_{epoch + 1:04d}")


def _optimizer(model: torch.nn.Module, train: TrainSettings) -> torch.optim.Optimizer:
    if train.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)


def _lr_schedule(optimizer: torch.optim.Optimizer, train: TrainSettings, steps_per_epoch: int):
    total = max(1, train.epochs * steps_per_epoch)
    if train.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


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


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


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
