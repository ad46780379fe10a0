"""One training step, top to bottom: the model wrapped in DDP or sharded by FSDP2 (compiled inside, if
asked for), a micro-batch's forward and backward (gradients synchronized only on a step's last
micro-batch), the optimizer step (gradients divided by the step's count, clipped, the schedule
stepped), and evaluation on this rank's validation rows."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config, DDPSettings
from raytrain_ddp.worker import sharding
from raytrain_ddp.worker.metrics import (
    all_gather,
)
from raytrain_ddp.worker.optim import Accumulation, Updater

logger = logging.getLogger(__name__)


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
    with _gradients_synced(ddp_model, accumulation.ends_step(i)):
        with updater.autocast():
            loss = compute_loss(ddp_model, batch)
        summed = isinstance(loss, tuple)
        updater.scaler.scale(loss[0] if summed else loss / accumulation.step_size(i)).backward()
    return (loss[0].detach(), loss[1]) if summed else loss.detach()


def _gradients_synced(trained: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Gradients reduced across ranks in the backward of a step's last micro-batch only: DDP's no_sync
    before it; FSDP2's switch, set for each micro-batch (a compiled module passes it on)."""
    if hasattr(trained, "set_requires_gradient_sync"):
        trained.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last or not hasattr(trained, "no_sync") else trained.no_sync()


def optimizer_step(updater: Updater, clip_norm: float | None, count: torch.Tensor | int | None = None) -> torch.Tensor:
    """Unscale the gradients (and, for a summed loss, divide them by `count` summed over every rank),
    clip them to a global L2 norm of `clip_norm`, step, zero them, and advance the schedule. Returns
    the norm before clipping, as a tensor on the device (reading it would wait for the GPU); with
    fp16, inf or nan when the gradients overflowed: the scaler then skips the step, and so does the
    schedule. Without `clip_norm` the gradients are only measured: `clip_grad_norm_` with an infinite
    bound would also multiply every gradient by 1, a second pass (0.3 ms of a 10 ms CPU step of
    the benchmark's MLP). Under FSDP2 the gradients are shards, and the norm is over all of them."""
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
    return sharding.full_tensor(norm).detach()


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


def trained_module(model: torch.nn.Module, config: Config, recipe: Recipe, device: torch.device) -> torch.nn.Module:
    """What trains: `model` in DDP (`wrap_model`), or (scaling.strategy=fsdp) `model` itself, sharded
    in place by FSDP2; compiled inside either, with train.compile."""
    if config.scaling.strategy == "ddp":
        return wrap_model(model, config.ddp, config.train.compile)
    sharding.shard(model, recipe, config, device)
    return compile_for_training(model) if config.train.compile else model


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


def evaluate(
    model: torch.nn.Module,
    recipe: Recipe,
    batches: Iterator[dict[str, torch.Tensor]],
    filler: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Global validation: the mean of each recipe metric over all ranks' rows, plus `samples` (every
    validation row, each counted once across ranks) and `samples_per_worker`. Leaves `model` in eval
    mode. `filler` (FSDP2, where every forward pass is a collective): rows a rank evaluates, and
    drops, while another rank still has batches of its own."""
    model.eval()
    rows, sums = 0, {}
    with torch.no_grad():
        for batch in batches if filler is None else _in_lockstep(batches, filler):
            if batch is None:
                recipe.evaluate(model, filler)
                continue
            for name, (total, count) in recipe.evaluate(model, batch).items():
                s, n = sums.get(name, (0.0, 0))
                sums[name] = (s + float(total), n + int(count))
            rows += row_count(batch)
    parts = all_gather((rows, sums))  # a rank that saw no batch still takes part
    means = {}
    for name in sorted({name for _, part in parts for name in part}):
        total = sum(part[name][0] for _, part in parts if name in part)
        count = sum(part[name][1] for _, part in parts if name in part)
        means[name] = total / max(count, 1)
    derived = recipe.derived_metrics(means) if recipe.derived_metrics is not None and means else {}
    return {"samples": sum(r for r, _ in parts), "samples_per_worker": [r for r, _ in parts], **means, **derived}


def _in_lockstep(
    batches: Iterator[dict[str, torch.Tensor]], filler: dict[str, torch.Tensor]
) -> Iterator[dict[str, torch.Tensor] | None]:
    """`batches`, then None for as long as another rank still has batches: the ranks' shares of the
    validation rows may differ by a batch."""
    device = next(iter(filler.values())).device
    batches = iter(batches)
    while True:
        batch = next(batches, None)
        more = torch.tensor(int(batch is not None), device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more:
            return
        yield batch


def row_count(batch: dict[str, torch.Tensor]) -> int:
    return len(next(iter(batch.values())))
