"""What every report carries, and how each rank's own numbers become one global figure.

A rank counts its samples, batches, loss and clocks in an `EpochMeter`; `combine` all-gathers the
meters and reduces them (sums of counts; throughput over the slowest rank's busy time; clocks
averaged per rank), so every rank reports the same global metrics. With the model's FLOPs known,
model FLOP/s and, on GPUs whose peak is known, MFU (flops.py).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from raytrain_ddp.worker.flops import ModelFlops, utilization

# What every report carries besides the recipe's `val_<name>` metrics (and tokens, if it counts them).
TRAIN_METRICS = (
    "epoch",
    "step",
    "workers",  # the attempt's number of workers: an elastic run's may change
    "lr",
    "train_loss",
    "grad_norm",
    "train_samples",
    "train_samples_per_worker",
    "train_batches",
    "samples_per_s",
    "data_wait_s",
    "compute_s",
    "compile_s",  # train.compile: the batches that compiled a graph, kept out of compute_s and the rates
    "data_wait_fraction",
    "data_wait_fraction_per_worker",
    "peak_memory_mb",
    "model_state_mb",  # parameters, gradients and optimizer state held by the most loaded worker
    "val_samples",
    "val_samples_per_worker",
    "epoch_time_s",
    "checkpoint_s",  # training blocked by the previous checkpoint
    "evals_since_best",  # SINCE_BEST
)
TOKEN_METRICS = ("train_tokens", "tokens_per_s")
FLOP_METRICS = ("model_flops_per_s",)  # when the model's FLOPs are known (flops.py)
# Only where, besides, every worker's GPU has a known peak: hardware the driver cannot know in advance,
# so not among `reported_metrics` (a score or a check cannot rely on them).
MFU_METRICS = ("mfu", "mfu_per_worker")
STOPPED = "stopped"  # only in a report without a checkpoint: why the workers stop the run (see loop.py)
STOPPED_EARLY = "stopped_early"  # only in the report that ends a run early (early_stopping.py): why
SINCE_BEST = "evals_since_best"  # evaluations since the score last improved (early_stopping.py)
STORAGE_RETRIED = "storage_retried"  # only in rank 0's report, after transient storage errors were retried
GENERATED = "generated"  # only in rank 0's report, with a recipe's generate_samples: [{column: text}]
BAD_FILES = "data_bad_file_names"  # a stream's: the files the ranks skipped as unreadable in the epoch


def reported_metrics(val_names: Iterable[str], counts_tokens: bool, counts_flops: bool = False) -> set[str]:
    """The keys of every report, given the names the recipe's `evaluate` (and derived_metrics) return
    (and, on GPUs whose peak is known, MFU_METRICS)."""
    return {
        *TRAIN_METRICS,
        *(TOKEN_METRICS if counts_tokens else ()),
        *(FLOP_METRICS if counts_flops else ()),
        *(f"val_{name}" for name in val_names),
    }


@dataclass
class EpochMeter:
    """One rank's training epoch: what it saw, and where its time went. Checkpointed mid-epoch
    (`state_dict`), so a resumed epoch reports the same totals as an uninterrupted one."""

    loss_sum: float = 0.0
    loss_count: float = 0.0  # what loss_sum sums over: rows, or the recipe's count (trained tokens, say)
    samples: int = 0
    tokens: int = 0
    batches: int = 0
    grad_norm_sum: float = 0.0
    steps: int = 0
    data_wait_s: float = 0.0  # blocked in next(batches)
    # Everything between two batches (forward, backward, step), less `paused` time: compute_s, or for
    # a batch marked `compiling` (a compiled model's first of each shape, per process) compile_s, with
    # its rows and tokens, kept out of the throughput: an epoch's rates and MFU are the steady step's,
    # not a mix with the compiler's tens of seconds.
    compute_s: float = 0.0
    compile_s: float = 0.0
    compile_samples: int = 0
    compile_tokens: int = 0
    earlier_s: float = 0.0  # wall time spent on this epoch before the attempt that resumed it

    def __post_init__(self) -> None:
        self._started = time.perf_counter()
        self._paused_s = 0.0
        self._compiling = False
        # Loss and gradient-norm sums not yet read back from the device: reading one per step would
        # make the host wait for the GPU every step. `settle` reads them once, at a report.
        self._pending_loss: torch.Tensor | float = 0.0
        self._pending_count: torch.Tensor | float = 0.0
        self._pending_norm: torch.Tensor | float = 0.0

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        iterator = iter(batches)
        while True:
            waiting = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            computing = time.perf_counter()
            self.data_wait_s += computing - waiting
            self._paused_s, samples, tokens = 0.0, self.samples, self.tokens
            yield batch
            spent = time.perf_counter() - computing - self._paused_s
            if self._compiling:
                self.compile_s += spent
                self.compile_samples += self.samples - samples
                self.compile_tokens += self.tokens - tokens
                self._compiling = False
            else:
                self.compute_s += spent

    def compiling(self) -> None:
        """The batch in hand compiles a graph: its time, rows and tokens are not the steady step's."""
        self._compiling = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time that is not training (evaluating, checkpointing) and must not count as compute."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - started

    def add_batch(self, loss_sum: torch.Tensor, count: torch.Tensor | int, samples: int, tokens: int | None) -> None:
        self._pending_loss = self._pending_loss + loss_sum.detach().float()
        self._pending_count = self._pending_count + count
        self.samples += samples
        self.tokens += tokens or 0
        self.batches += 1

    def add_step(self, grad_norm: torch.Tensor | float) -> None:
        self._pending_norm = self._pending_norm + grad_norm
        self.steps += 1

    def settle(self) -> None:
        """Fold the sums still on the device into loss_sum, loss_count and grad_norm_sum (one device sync)."""
        self.loss_sum += float(self._pending_loss)
        self.loss_count += float(self._pending_count)
        self.grad_norm_sum += float(self._pending_norm)
        self._pending_loss, self._pending_count, self._pending_norm = 0.0, 0.0, 0.0

    def epoch_time_s(self) -> float:
        return self.earlier_s + time.perf_counter() - self._started

    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return asdict(self) | {"earlier_s": self.epoch_time_s()}


def combine(
    meter: EpochMeter, counts_tokens: bool, device: torch.device, flops: ModelFlops | None = None, state_bytes: int = 0
) -> dict[str, Any]:
    """The epoch's global training metrics, the same on every rank. `state_bytes`: what this rank holds
    of the model's parameters, gradients and optimizer state (sharding.state_bytes)."""
    meter.settle()
    gathered = all_gather((asdict(meter), _peak_memory_mb(device), flops.peak if flops else None, state_bytes))
    states = [state for *_, state in gathered]
    gathered = [part[:3] for part in gathered]
    parts = [EpochMeter(**fields) for fields, _, _ in gathered]
    samples = sum(p.samples for p in parts)
    steady = [_steady(p) for p in parts]
    busy = max(b for _, _, b in steady)  # the slowest rank sets the pace
    metrics = {
        "train_loss": sum(p.loss_sum for p in parts) / max(sum(p.loss_count for p in parts), 1e-12),
        "grad_norm": meter.grad_norm_sum / max(meter.steps, 1),  # of the all-reduced gradient: rank-independent
        "train_samples": samples,
        "train_samples_per_worker": [p.samples for p in parts],
        "train_batches": sum(p.batches for p in parts),
        "samples_per_s": sum(n for n, _, _ in steady) / max(busy, 1e-9),
        "data_wait_s": sum(p.data_wait_s for p in parts) / len(parts),
        "compute_s": sum(p.compute_s for p in parts) / len(parts),
        "compile_s": sum(p.compile_s for p in parts) / len(parts),
        "data_wait_fraction": sum(p.data_wait_s for p in parts)
        / max(sum(p.data_wait_s + p.compute_s for p in parts), 1e-9),
        "data_wait_fraction_per_worker": [p.data_wait_s / max(p.data_wait_s + p.compute_s, 1e-9) for p in parts],
        "peak_memory_mb": max(memory for _, memory, _ in gathered),
        "model_state_mb": max(states) / 2**20,
    }
    if counts_tokens:
        tokens = sum(p.tokens for p in parts)
        metrics |= {"train_tokens": tokens, "tokens_per_s": sum(t for _, t, _ in steady) / max(busy, 1e-9)}
    if flops is not None and flops.known:
        metrics |= utilization(
            [flops.trained(n, t) for n, t, _ in steady], [b for _, _, b in steady], [peak for _, _, peak in gathered]
        )
    return metrics


def _steady(part: EpochMeter) -> tuple[int, int, float]:
    """A rank's (samples, tokens, busy seconds) for the throughput: without the batches that compiled,
    unless those were all it trained (then with them: a rate, if not the steady one)."""
    if part.samples == part.compile_samples:
        return part.samples, part.tokens, part.data_wait_s + part.compute_s + part.compile_s
    return (
        part.samples - part.compile_samples,
        part.tokens - part.compile_tokens,
        part.data_wait_s + part.compute_s,
    )


def all_gather(obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order (just `[obj]` outside a process group)."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _peak_memory_mb(device: torch.device) -> float:
    """GPU: the most this rank's tensors held at once since the last call; CPU: the process's peak RSS."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
