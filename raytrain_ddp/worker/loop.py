"""The program every Ray Train worker runs: build, resume, train, evaluate, report.

`driver.run` starts it through TorchTrainer. Two names for the model: `model` is what we build, save
and evaluate; `ddp_model` is the DDP wrapper we train through. Every rank reports at the end of each
epoch and every `checkpoint.every_n_steps` steps (`ray.train.report` is a barrier); only rank 0 writes
the checkpoint. Metrics are global: sums and counts are combined across ranks before anything is
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
import queue
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import CheckpointConsistencyMode, CheckpointUploadMode

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.checkpoint import storage
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config, DDPSettings
from raytrain_ddp.data import datasets as data
from raytrain_ddp.data import seeds
from raytrain_ddp.worker.early_stopping import EarlyStopping
from raytrain_ddp.worker.flops import ModelFlops
from raytrain_ddp.worker.metrics import (
    GENERATED,
    SINCE_BEST,
    STOPPED,
    STOPPED_EARLY,
    STORAGE_RETRIED,
    EpochMeter,
    all_gather,
    combine,
)
from raytrain_ddp.worker.optim import Accumulation, Updater
from raytrain_ddp.worker.progress import Beacon
from raytrain_ddp.worker.timeline import WorkerMarks
from raytrain_ddp.worker.timeline import strip as strip_marks

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
    ddp_model: torch.nn.Module  # what trains: `model` in DDP (compiled inside, if asked for)
    storage_retries: StorageRetries  # rank 0's storage errors retried, until its next report


@dataclass(frozen=True)
class Position:
    """Where training stands: `epoch` epochs done, `batches` micro-batches into the next, `step`
    optimizer steps in all."""

    epoch: int
    batches: int
    step: int


@dataclass(frozen=True)
class Blocked:
    """How long the previous checkpoint blocked training. Reported with the next."""

    checkpoint_s: float = 0.0


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
            summed, rows = isinstance(loss, tuple), _rows(batch)
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

    # 1. Build the same model on every rank, wrap it in DDP (compiled inside, if asked for), then
    #    optimizer, schedule and precision.
    torch.manual_seed(config.seed)
    model = recipe.make_model(config, loop_config["fitted"])
    ddp_model = wrap_model(model, config.ddp, config.train.compile)
    updater = Updater(model, config.train, accumulation.steps, device)

    # 2. Resume where the newest checkpoint that verifies left off (to the micro-batch, with every
    #    rank's random state), or seed this rank's own random stream: for a new run, or from the
    #    epoch on for a run resumed on another number of workers (at an epoch's end: pre-flight).
    start, retrained = _resume(model, updater, config, worker_data.world_size)
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


class CompiledShapes:
    """The batch shapes this process's compiled model has trained on. With static shapes each new one
    compiles a graph (seconds to minutes, in that batch's forward and backward), up to dynamo's
    recompile limit, beyond which new shapes run eagerly."""

    def __init__(self):
        import torch._dynamo  # imported already, by torch.compile

        self.seen: set[tuple] = set()
        self.limit = getattr(torch._dynamo.config, "recompile_limit", 8)

    def new(self, batch: dict[str, torch.Tensor]) -> bool:
        shape = tuple((key, tuple(value.shape)) for key, value in batch.items() if isinstance(value, torch.Tensor))
        if shape in self.seen or len(self.seen) >= self.limit:
            return False
        self.seen.add(shape)
        return True


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


def forward_backward(
    ddp_model: torch.nn.Module,
    compute_loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], Any],
    batch: dict[str, torch.Tensor],
    updater: Updater,
    accumulation: Accumulation,
    i: int,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | int]:
    """Micro-batch `i` of the epoch: the forward pass under autocast, then the backward pass. A mean
    loss is divided by the micro-batches of its step (K micro-batches of B rows average like one batch
    of K x B); a loss the recipe sums over `count` items is back-propagated as a sum, and
    `optimizer_step` divides the step's gradient by the global count. DDP all-reduces the gradients on
    a step's last micro-batch only; before it they accumulate locally. Returns the loss as the recipe
    did, detached."""
    last = accumulation.ends_step(i)
    with contextlib.nullcontext() if last or not hasattr(ddp_model, "no_sync") else ddp_model.no_sync():
        with updater.autocast():
            loss = compute_loss(ddp_model, batch)
        summed = isinstance(loss, tuple)
        updater.scaler.scale(loss[0] if summed else loss / accumulation.step_size(i)).backward()
    return (loss[0].detach(), loss[1]) if summed else loss.detach()


def optimizer_step(updater: Updater, clip_norm: float | None, count: torch.Tensor | int | None = None) -> torch.Tensor:
    """Unscale the gradients (and, for a summed loss, divide them by `count` summed over every rank),
    clip them to a global L2 norm of `clip_norm`, step, zero them, and advance the schedule. Returns
    the norm before clipping, as a tensor on the device (reading it would wait for the GPU); with
    fp16, inf or nan when the gradients overflowed: the scaler then skips the step, and so does the
    schedule. Without `clip_norm` the gradients are only measured: `clip_grad_norm_` with an infinite
    bound would also multiply every gradient by 1, a second pass (0.3 ms of a 10 ms CPU step of
    the benchmark's MLP)."""
    optimizer, scaler = updater.optimizer, updater.scaler
    scaler.unscale_(optimizer)
    if count is not None:
        _divide_gradients(updater.parameters, count, updater.device)
    norm = torch.nn.utils.get_total_norm([p.grad for p in updater.parameters if p.grad is not None])
    if clip_norm:
        torch.nn.utils.clip_grads_with_norm_(updater.parameters, clip_norm, norm)
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if scale is None or scaler.get_scale() >= scale:  # a lowered scale means a skipped step
        updater.scheduler.step()
    return norm.detach()


def _divide_gradients(parameters: list[torch.nn.Parameter], count: torch.Tensor | int, device: torch.device) -> None:
    """DDP averaged the ranks' gradient sums: times world size / global count, they are the gradient
    of the mean over every item of the global batch. One all-reduce of one number per step."""
    total = torch.as_tensor(count, dtype=torch.float32, device=device).clone()
    world = 1
    if dist.is_initialized():
        dist.all_reduce(total)
        world = dist.get_world_size()
    if grads := [p.grad for p in parameters if p.grad is not None]:
        torch._foreach_mul_(grads, world / total.clamp(min=1))


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
    with meter.paused(), _rank0_buffers(model, keep_own=own_buffers), worker.updater.autocast():
        metrics = {
            "epoch": at.epoch + at.batches / worker.accumulation.micro_batches,
            "step": at.step,
            "workers": worker.data.world_size,
            "lr": worker.updater.lr,
            **combine(meter, recipe.count_tokens is not None, worker.data.device, worker.flops),
            **{f"val_{name}": value for name, value in evaluate(model, recipe, worker.data.val_batches()).items()},
            "epoch_time_s": meter.epoch_time_s(),
            **asdict(blocked),
            **worker.marks.pop(),
        }
        if recipe.generate_samples is not None and worker.rank == 0:  # rank 0's report is the one logged
            metrics[GENERATED] = _generate(model, recipe, worker.example, worker.data.device)
        bad_files = None
        if worker.data.reads_files:
            read, bad_files = _stream_read(worker)
            metrics |= {"data_rows_read": read, "data_bad_files": len(bad_files)}
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
        state = ckpt.TrainingState(
            at.epoch, at.step, worker.updater.state_dict(), list(rng), at.batches, meters, early.state_dict()
        )
        name = ckpt.dir_name(at.epoch, at.step, at.batches)
        name = f"{name}-retrained" if name in worker.retrained else name
        return _save_and_report(metrics, model, state, config, worker.rank, name, worker.storage_retries)


def wrap_model(model: torch.nn.Module, ddp: DDPSettings, compile: bool = False) -> torch.nn.Module:
    """DDP with the configured keyword arguments (after SyncBatchNorm conversion, if asked for), around
    the model compiled for training if `compile` (see `compile_for_training`). `model` stays the
    unwrapped, uncompiled module: converted BatchNorm layers keep the same state_dict keys, and a
    compiled one adds none (no `_orig_mod.`)."""
    if ddp.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    trained = compile_for_training(model) if compile else model
    return ray.train.torch.prepare_model(trained, parallel_strategy_kwargs=ddp.model_dump(exclude={"sync_batchnorm"}))


def compile_for_training(model: torch.nn.Module) -> torch.nn.Module:
    """`model` compiled (torch.compile, inductor), for DDP to wrap: only training runs compiled.

    Inside DDP, not around it as torch's DDP notes show: dynamo splits a graph it compiles within
    DDP's forward at DDP's buckets either way (DDPOptimizer, torch/_dynamo/convert_frame.py), so each
    bucket's all-reduce starts while the backward pass goes on. But compiling the DDP wrapper breaks
    the graph in DDP's forward, and dynamo then compiles only frames of user code below it: a model
    whose top module is a torch container (nn.Sequential, as the benchmark's MLP) ran entirely eager
    (seen: no graph at all). Compiling the module itself compiles it whatever its class. Not in place
    (`model.compile()`): `model` is also what evaluates, generates and is saved.

    Evaluation and generation stay eager, on `model`: the reported validation metrics are those of
    the module as it is checkpointed and registered (and as MLflow serves it), evaluation compiles
    nothing (an eval-mode graph per eval batch shape, for one pass an epoch), and generation's growing
    sequences would recompile at each new length.

    `dynamic=False`: one graph per batch shape, chosen by the shape alone, each compiled once (a short
    last batch is one more graph, not a recompilation every epoch). With automatic dynamic shapes the
    graph a batch runs through would depend on the shapes the process saw before it, and a resumed
    run, a new process, could round differently from the run it continues. A recipe whose batch
    shapes vary from batch to batch (text cut to each batch's longest) compiles a graph per shape up
    to torch._dynamo.config.recompile_limit (8), then runs new shapes eagerly: leave it uncompiled."""
    return torch.compile(model, dynamic=False)


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
    means = {}
    for name in sorted({name for _, part in parts for name in part}):
        total = sum(part[name][0] for _, part in parts if name in part)
        count = sum(part[name][1] for _, part in parts if name in part)
        means[name] = total / max(count, 1)
    derived = recipe.derived_metrics(means) if recipe.derived_metrics is not None and means else {}
    return {"samples": sum(r for r, _ in parts), "samples_per_worker": [r for r, _ in parts], **means, **derived}


def _generate(
    model: torch.nn.Module, recipe: Recipe, example: dict[str, torch.Tensor], device: torch.device
) -> list[dict[str, str]]:
    """What the model generates from the example rows (the recipe says how), in eval mode."""
    model.eval()
    with torch.no_grad():
        return recipe.generate_samples(model, {name: column.to(device) for name, column in example.items()})


def _resume(
    model: torch.nn.Module, updater: Updater, config: Config, world_size: int
) -> tuple[ckpt.TrainingState | None, frozenset[str]]:
    """Load the newest checkpoint of the run that verifies: one written and reported but not recorded
    by Ray (its worker died before the controller's poll: reported again here, so Ray records it),
    else Ray's latest, else (damaged, or mid-epoch for another number of workers) the newest committed
    one before it. Returns its training state (None for a new run, or an elastic one resized in its
    first epoch) and the names of the checkpoints skipped, which training will pass again and must
    not overwrite."""
    latest = ray.train.get_checkpoint()
    run_path = config.run.path
    unrecorded = ckpt.unrecorded(run_path, None if latest is None else Path(latest.path).name)
    if latest is None and not unrecorded:
        return None, frozenset()
    committed = ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    committed = ((c.checkpoint, c.metrics) for c in committed)
    elastic = config.scaling.elastic  # resized by Ray: in its first epoch, it may start over
    with ckpt.open_resume_point(latest, committed, unrecorded, world_size, start_over=elastic) as opened:
        if opened is None:  # nothing recorded, and nothing written whole
            return None, frozenset()
        for skipped in opened.skipped:
            logger.warning("skipping checkpoint %s", skipped)
        passed_over = frozenset(skipped.name for skipped in opened.skipped)
        chosen = all_gather(None if opened.checkpoint is None else opened.name)
        if len(set(chosen)) != 1:
            raise ckpt.CheckpointError(
                f"the ranks found different checkpoints valid ({chosen}): is the storage shared?"
            )
        if opened.checkpoint is None:  # every checkpoint mid-epoch 1, of another number of workers
            return None, passed_over
        ckpt.load_weights(model, opened.verified.model_state())
        state = opened.verified.training_state()
        if not opened.recorded:
            _report_again(opened)
    if len(state.rng) != world_size and state.batches:  # open_resume_point passes them over
        raise RuntimeError(
            f"checkpoint {opened.name} is mid-epoch, written by {len(state.rng)} workers; this run has "
            f"{world_size}: resume with scaling.num_workers={len(state.rng)} to the epoch's end"
        )
    updater.load_state_dict(state.updater)
    return state, passed_over


def _report_again(opened: ckpt.Opened) -> None:
    """Report a checkpoint that is on storage but not in Ray's record, from every rank, with the
    metrics it was reported with: Ray records it where it is (nothing is copied), logs its metrics
    and ranks it among the run's checkpoints, as if the first report had reached the controller."""
    metrics = strip_marks(opened.verified.metrics())
    on_storage = opened.checkpoint if ray.train.get_context().get_world_rank() == 0 else None
    ray.train.report(
        metrics,
        checkpoint=on_storage,
        checkpoint_dir_name=opened.name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,  # on storage already, as a sync checkpoint is
    )


def _save_and_report(
    metrics: dict[str, Any],
    model: torch.nn.Module,
    state: ckpt.TrainingState,
    config: Config,
    rank: int,
    name: str,
    retries: StorageRetries,
) -> Blocked | None:
    """Report with rank 0's checkpoint. Returns how long training was blocked, or None when the
    checkpoint could not be written and the run must stop (every rank then reports why).

    Rank 0 writes the checkpoint to a local directory, and `storage.upload` copies it to the run's
    directory, the manifest last, retrying transient storage errors (checkpoint.upload_retry_s); one
    that is not transient, or lasts, leaves nothing of it that looks like a checkpoint. sync: the
    upload ends before the report, so the report returns once the checkpoint is whole on storage.
    Training goes on without waiting for Ray's controller to record it: a worker that dies before it
    does leaves the checkpoint on storage, where the restart finds it (`_resume`). Every rank learns
    from rank 0 how the upload went: a storage that stays down, is full or refuses this writer stops
    the run (a restart would train again to the same failed write), any other error fails the
    attempt on every rank (Ray restarts it, within run.max_failures). async: Ray uploads it in a
    background thread; training goes on at once, and a failure before the upload ends (a failed
    upload too) fails the attempt, which resumes from the checkpoint before."""
    started = time.perf_counter()
    local = None
    if rank == 0:
        local = tempfile.mkdtemp(prefix=f"raytrain_ddp-{name}-")
        ckpt.save(local, model=model, state=state, config=config.to_dict(), metrics=strip_marks(metrics))
    if config.checkpoint.upload == "async":
        ray.train.report(
            metrics | retries.pop(),
            checkpoint=None if local is None else ray.train.Checkpoint.from_directory(local),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=True,
            checkpoint_upload_fn=lambda checkpoint, _name: _upload(checkpoint.path, name, config, retries, by_ray=True),
        )
        return Blocked(checkpoint_s=time.perf_counter() - started)
    uploaded, failed = None, None
    if local is not None:
        try:
            uploaded = _upload(local, name, config, retries)
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
    local: str, name: str, config: Config, retries: StorageRetries, by_ray: bool = False
) -> ray.train.Checkpoint:
    """Copy the checkpoint written in `local` to the run's directory on storage, as `name`, then
    remove `local`. `by_ray`: the upload is Ray's (async), which removes `local` once it succeeds and
    may call again after a transient error, so `local` stays until then."""
    run_storage = ray.train.get_context().get_storage()
    fs, where = run_storage.storage_filesystem, run_storage.build_checkpoint_path_from_name(name)
    retried: list[str] = []
    try:
        run_storage._check_validation_file()  # as Ray's own upload does: this node sees the run's storage
        storage.upload(local, fs, where, ckpt.FILES, config.checkpoint.upload_retry_s, retried)
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


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return len(next(iter(batch.values())))


def _threads_as_ray_says() -> None:
    """Torch's threads as Ray sets them for a worker's CPUs (OMP_NUM_THREADS, set as it starts the
    actor; 1 for half a CPU). A worker started ahead loaded torch before, and OpenMP took its count
    then, from the whole machine's cores: two such ranks on a small machine oversubscribe its cores,
    and a CNN's epochs take several times as long. The loop calls it first."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
