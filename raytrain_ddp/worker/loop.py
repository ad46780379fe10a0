"""The program every Ray Train worker runs: build, resume, train, evaluate, report.

`driver.run` starts it through TorchTrainer. Two names for the model: `model` is what we build, save
and evaluate; `ddp_model` is the DDP wrapper we train through (under FSDP2, `model` itself, sharded in
place, or compiled). Every rank reports at the end of each epoch and every `checkpoint.every_n_steps`
steps (`ray.train.report` is a barrier); only rank 0 writes the checkpoint (under FSDP2 every rank
writes its shards, rank 0 the rest). Metrics are global: sums and counts are combined across ranks before anything is
reported, so every rank takes the same decisions, stopping included.

Resume is exact: an epoch's data order is a function of (seed, epoch), a checkpoint holds every
rank's random state and the micro-batch training stopped at, and a resumed epoch starts at the first
batch not trained (a stream reads from there; a Ray or torch Dataset reads the epoch again and passes
over the batches trained). Restarted after a failure, the result equals that of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config
from raytrain_ddp.data import datasets as data
from raytrain_ddp.data import seeds
from raytrain_ddp.worker import sharding
from raytrain_ddp.worker.early_stopping import EarlyStopping
from raytrain_ddp.worker.flops import ModelFlops
from raytrain_ddp.worker.metrics import (
    BAD_FILES,
    GENERATED,
    SINCE_BEST,
    STOPPED,
    STOPPED_EARLY,
    EpochMeter,
    all_gather,
    combine,
)
from raytrain_ddp.worker.optim import Accumulation, Updater
from raytrain_ddp.worker.progress import Beacon
from raytrain_ddp.worker.report import Blocked, StorageRetries, save_and_report
from raytrain_ddp.worker.resume import resume
from raytrain_ddp.worker.step import (
    CompiledShapes,
    evaluate,
    forward_backward,
    optimizer_step,
    row_count,
    trained_module,
)
from raytrain_ddp.worker.timeline import WorkerMarks

logger = logging.getLogger(__name__)
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train's setting (session.fit_environment)


@dataclass(frozen=True)
class Worker:
    """What this rank trains with, fixed for the attempt."""

    config: Config
    recipe: Recipe
    rank: int
    data: data.WorkerData
    model: torch.nn.Module  # built, evaluated and saved; `ddp_model` wraps it for training
    updater: Updater
    accumulation: Accumulation
    retrained: frozenset[str]  # checkpoints passed over that training passes again: it writes `<name>-retrained`
    example: dict[str, torch.Tensor]  # two validation rows: what the model generates from at each evaluation
    marks: WorkerMarks  # rank 0's phases (the run's timeline), sent with its next report
    flops: ModelFlops  # what a training step costs, and this rank's device's peak: for model FLOP/s and MFU
    early_stopping: EarlyStopping  # the score's patience counter: the same on every rank
    beacon: Beacon  # rank 0's live progress, sent to the driver between reports (progress.py)
    ddp_model: torch.nn.Module  # what trains: `model` in DDP, or sharded (compiled inside, if asked for)
    storage_retries: StorageRetries  # rank 0's storage errors retried, until its next report


@dataclass(frozen=True)
class Position:
    """Where training stands: `epoch` epochs done, `batches` micro-batches into the next, `step`
    optimizer steps in all."""

    epoch: int
    batches: int
    step: int


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    _threads_as_ray_says()
    config = Config.from_dict(loop_config["config"])
    worker, start = _build_and_resume(config, loop_config)  # 1. and 2.
    recipe, worker_data, rank, marks = worker.recipe, worker.data, worker.rank, worker.marks
    ddp_model, updater, accumulation = worker.ddp_model, worker.updater, worker.accumulation
    if worker.early_stopping.stops:  # restarted after the report that ended the run early: it has ended
        return
    step, blocked, step_count = start.step, Blocked(), None
    preemption = PreemptionCheck(config.checkpoint.preemption_check_steps)
    compiled = CompiledShapes() if config.train.compile else None

    # 3. Train: one optimizer step per `accumulation.per_step` micro-batches. Evaluate and checkpoint
    #    every checkpoint.every_n_steps steps, as soon as a node of the run is being preempted, and at
    #    the end of each epoch; stop early once the score has not improved for train.early_stopping.patience
    #    evaluations.
    every = config.checkpoint.every_n_steps
    for epoch in range(start.epoch, config.train.epochs):
        resumed = epoch == start.epoch and start.batches > 0
        meter = EpochMeter(**start.meters[rank]) if resumed else EpochMeter()
        first = start.batches if resumed else 0  # a resumed epoch starts at the first batch it did not train
        ddp_model.train()
        for i, batch in enumerate(meter.timed(worker_data.train_batches(epoch, first)), start=first):
            marks.once("first batch")
            if compiled and compiled.new(batch):
                meter.compiling()
            loss = forward_backward(ddp_model, recipe.compute_loss, batch, updater, accumulation, i)
            summed, rows = isinstance(loss, tuple), row_count(batch)
            loss_sum, count = loss if summed else (loss * rows, rows)  # a mean loss sums over rows
            meter.add_batch(loss_sum, count, rows, recipe.count_tokens(batch) if recipe.count_tokens else None)
            step_count = (0 if step_count is None else step_count) + count if summed else None
            if not accumulation.ends_step(i):
                continue
            meter.add_step(optimizer_step(updater, config.train.grad_clip_norm, step_count))
            step, step_count = step + 1, None
            tokens = meter.tokens if recipe.count_tokens else None
            worker.beacon.note(step, epoch + (i + 1) / accumulation.micro_batches, loss_sum, count, tokens)
            marks.once("first step")
            due = every and step % every == 0
            preempted = preemption.just_now(step)
            if (due or preempted) and i + 1 < accumulation.micro_batches:
                at = Position(epoch, i + 1, step)
                blocked = evaluate_and_checkpoint(worker, at, meter, blocked, counts=bool(due))
                if blocked is None or worker.early_stopping.stops:
                    return
                if preempted:
                    preemption.wait_for_the_restart()
                ddp_model.train()
        if meter.batches != accumulation.micro_batches:  # the accumulation groups assume the count
            raise RuntimeError(
                f"rank {rank} got {meter.batches} batches in epoch {epoch + 1}, expected {accumulation.micro_batches}"
            )
        if epoch + 1 == config.train.epochs:
            marks.mark("last step")
        blocked = evaluate_and_checkpoint(worker, Position(epoch + 1, 0, step), meter, blocked)
        if blocked is None or worker.early_stopping.stops:
            return
        if preemption.seen and epoch + 1 < config.train.epochs:  # seen at the epoch's last step
            preemption.wait_for_the_restart()


def _build_and_resume(config: Config, loop_config: dict[str, Any]) -> tuple[Worker, ckpt.TrainingState]:
    recipe: Recipe = loop_config["recipe"]
    worker_data = data.WorkerData(loop_config["shipped_datasets"], config.train, config.data, config.seed)
    rank, device = worker_data.rank, worker_data.device
    marks = WorkerMarks(rank)
    marks.mark("loop")
    accumulation = Accumulation.on(config, loop_config["train_rows"], worker_data.world_size)

    # 1. Build the same model on every rank, wrap it in DDP or shard it (compiled inside, if asked
    #    for), then optimizer, schedule and precision.
    torch.manual_seed(config.seed)
    model = recipe.make_model(config, loop_config["fitted"])
    ddp_model = trained_module(model, config, recipe, device)
    updater = Updater(model, config.train, accumulation.steps, device)

    # 2. Resume where the newest checkpoint that verifies left off (to the micro-batch, with every
    #    rank's random state), or seed this rank's own random stream: for a new run, or from the
    #    epoch on for a run resumed on another number of workers (at an epoch's end: pre-flight).
    start, retrained = resume(model, updater, config, worker_data.world_size)
    if start is not None and len(start.rng) == worker_data.world_size:
        ckpt.set_rng_state(start.rng[rank])
    elif start is not None:
        _seed_everything(seeds.derive_seed(config.seed, seeds.WORKER_RNG, rank, start.epoch))
    else:
        start = ckpt.TrainingState(epoch=0, step=0, updater={}, rng=[])
        _seed_everything(seeds.derive_seed(config.seed, seeds.WORKER_RNG, rank))
    flops = loop_config["flops"].on(device, config.train.precision, rank)
    worker = Worker(
        config,
        recipe,
        rank,
        worker_data,
        model,
        updater,
        accumulation,
        retrained,
        loop_config["example"],
        marks,
        flops,
        EarlyStopping.of(config, start.early_stopping),
        Beacon(loop_config["progress"] if rank == 0 else None, config.run.progress_s, worker_data.world_size),
        ddp_model,
        StorageRetries(),
    )
    marks.mark("model")
    return worker, start


class PreemptionCheck:
    """Every `every` optimizer steps, whether Ray Train reports a node of the worker group as being
    preempted (drained: a spot instance reclaimed); True once, the first time, for a checkpoint just in
    time. Asking is a barrier of the ranks (through Ray Train's synchronization actor), so it is asked
    only where Ray Train watches for preemptions (session.fit_environment turns the watcher off on a
    one-machine cluster).

    After that checkpoint every rank waits for Ray Train to restart the workers at the reclaim's
    deadline: the steps trained meanwhile would be lost with the node, and a collective cut short by
    the node's end would fail the surviving ranks first, which Ray would then count as a failure. The
    restart is charged to Ray's max_preemption_failures (unlimited), not to run.max_failures."""

    def __init__(self, every: int):
        watched = os.environ.get(PREEMPTION_WATCHER_ENV, "1") != "0"
        watched = watched and hasattr(ray.train, "get_preemption_info")  # Ray Train's, from Ray 2.58
        self.every, self.seen = (every if watched else 0), False

    def just_now(self, step: int) -> bool:
        if not self.every or self.seen or step % self.every:
            return False
        info = ray.train.get_preemption_info()
        if info is None:
            return False
        self.seen = True
        logger.warning("node(s) %s being preempted: a checkpoint now", ", ".join(info.preempted_node_ids))
        return True

    def wait_for_the_restart(self) -> None:
        while True:  # Ray Train stops this worker at the deadline (or once the node is gone)
            time.sleep(1)


def evaluate_and_checkpoint(
    worker: Worker, at: Position, meter: EpochMeter, blocked: Blocked, counts: bool = True
) -> Blocked | None:
    """Evaluate, then report the global metrics from every rank, with rank 0's checkpoint of where
    training stands. Returns how long the checkpoint blocked training, or None when the run must stop:
    every rank sees the same global metrics, so every rank stops at the same report, which then
    carries the reason and no checkpoint. Every rank counts the evaluation in its early stopping's
    patience alike (`counts`: not one taken because a node is being preempted, which an uninterrupted
    run would not have); the report that spends it says why, with its checkpoint, and training ends."""
    config, model, recipe = worker.config, worker.model, worker.recipe
    own_buffers = not config.ddp.broadcast_buffers
    sharded = sharding.is_sharded(model)  # every forward pass is a collective: every rank takes part
    example = {name: column.to(worker.data.device) for name, column in worker.example.items()}
    with meter.paused(), _rank0_buffers(model, keep_own=own_buffers), worker.updater.autocast():
        state_bytes = sharding.state_bytes(model, worker.updater.optimizer)
        metrics = {
            "epoch": at.epoch + at.batches / worker.accumulation.micro_batches,
            "step": at.step,
            "workers": worker.data.world_size,
            "lr": worker.updater.lr,
            **combine(meter, recipe.count_tokens is not None, worker.data.device, worker.flops, state_bytes),
            **{
                f"val_{name}": value
                for name, value in evaluate(
                    model, recipe, worker.data.val_batches(), filler=example if sharded else None
                ).items()
            },
            "epoch_time_s": meter.epoch_time_s(),
            **asdict(blocked),
            **worker.marks.pop(),
        }
        if recipe.generate_samples is not None and (worker.rank == 0 or sharded):
            generated = _generate(model, recipe, example)
            if worker.rank == 0:  # rank 0's report is the one logged
                metrics[GENERATED] = generated
        bad_files = None
        if worker.data.reads_files:
            read, bad_files = _stream_read(worker)
            metrics |= {"data_rows_read": read, "data_bad_files": len(bad_files), BAD_FILES: bad_files}
        problem = _stop_reason(metrics, config.checkpoint.score_attribute) or _too_many_bad(bad_files, config)
        if problem is not None:
            ray.train.report({**metrics, STOPPED: problem})
            return None
        early = worker.early_stopping
        if counts:
            early.update(metrics[config.checkpoint.score_attribute])
        metrics[SINCE_BEST] = early.since_best
        if early.stops and (at.epoch, at.batches) != (config.train.epochs, 0):  # else it ends anyway
            metrics[STOPPED_EARLY] = early.reason()
        rng, meters = zip(*all_gather((ckpt.rng_state(), meter.state_dict() if at.batches else None)))
        meters = list(meters) if at.batches else []
        updater = worker.updater.state_dict(with_optimizer=not sharded)  # sharded: in every rank's shards
        state = ckpt.TrainingState(at.epoch, at.step, updater, list(rng), at.batches, meters, early.state_dict())
        name = ckpt.dir_name(at.epoch, at.step, at.batches)
        name = f"{name}-retrained" if name in worker.retrained else name
        optimizer = worker.updater.optimizer if sharded else None
        return save_and_report(metrics, model, state, config, worker.rank, name, worker.storage_retries, optimizer)


def _generate(model: torch.nn.Module, recipe: Recipe, example: dict[str, torch.Tensor]) -> list[dict[str, str]]:
    """What the model generates from the example rows (the recipe says how), in eval mode."""
    model.eval()
    with torch.no_grad():
        return recipe.generate_samples(model, example)


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


def _stream_read(worker: Worker) -> tuple[int, list[str]]:
    """A stream's training rows the ranks read in this epoch (since its start, or the point it resumed
    from: a resumed epoch does not read again what it trained), and the files they skipped as unreadable."""
    parts = all_gather(worker.data.stream_read())
    return sum(read for read, _ in parts), sorted(set().union(*(bad for _, bad in parts)))


def _too_many_bad(bad_files: list[str] | None, config: Config) -> str | None:
    if not bad_files or len(bad_files) <= config.data.max_bad_files:
        return None
    shown = ", ".join(bad_files[:5]) + (" ..." if len(bad_files) > 5 else "")
    return (
        f"{len(bad_files)} unreadable file(s) skipped this epoch, more than data.max_bad_files="
        f"{config.data.max_bad_files}: {shown}; repair or remove them, or raise data.max_bad_files"
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _threads_as_ray_says() -> None:
    """Torch's threads as Ray sets them for a worker's CPUs (OMP_NUM_THREADS, set as it starts the
    actor; 1 for half a CPU). A worker started ahead loaded torch before, and OpenMP took its count
    then, from the whole machine's cores: two such ranks on a small machine oversubscribe its cores,
    and a CNN's epochs take several times as long. The loop calls it first."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
