"""What a worker updates its model with, built from `train.*` settings: the optimizer (weight decay on
matrices only), the LR schedule (warmup, then constant, cosine or step), the grad scaler of fp16
precision, and how an epoch's micro-batches group into optimizer steps. One step itself (accumulate
with no_sync, unscale, clip, step, schedule) is taken in `loop.py`, where it reads top to bottom.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from raytrain_ddp.config.schema import Config, TrainSettings

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FUSED_DEVICES = ("cpu", "cuda")  # where torch has fused AdamW and SGD kernels (and this service runs)


@dataclass(frozen=True)
class Accumulation:
    """How a worker's micro-batches of an epoch group into optimizer steps: `per_step` each
    (train.grad_accum_steps), the epoch's last step taking what is left."""

    micro_batches: int  # per worker and epoch
    per_step: int

    @classmethod
    def on(cls, config: Config, train_rows: int, world_size: int) -> Accumulation:
        """An epoch of `train_rows` rows on `world_size` workers: each worker's share of the rows in
        micro-batches, and its share of a step's (the global batch stays, see `Config.accumulation_on`)."""
        t = config.train
        micro_batches = batches_per_epoch(train_rows, world_size, t.batch_size, t.drop_last)
        return cls(micro_batches, config.accumulation_on(world_size))

    @property
    def steps(self) -> int:
        return optimizer_steps(self.micro_batches, self.per_step)

    def ends_step(self, i: int) -> bool:
        """Whether micro-batch `i` (0-based, in the epoch) is the last of its optimizer step."""
        return (i + 1) % self.per_step == 0 or i + 1 >= self.micro_batches

    def step_size(self, i: int) -> int:
        """The micro-batches in the optimizer step of micro-batch `i`."""
        start = i - i % self.per_step
        return max(1, min(self.per_step, self.micro_batches - start))


class Updater:
    """One worker's optimizer, LR schedule and grad scaler: built together, checkpointed together."""

    def __init__(self, model: torch.nn.Module, train: TrainSettings, steps_per_epoch: int, device: torch.device):
        self.train, self.device = train, device
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, train)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, train, steps_per_epoch)
        )
        # fp16 needs loss scaling against underflow; disabled, the scaler passes everything through.
        self.scaler = torch.amp.GradScaler(device.type, enabled=train.precision == "fp16")

    def autocast(self) -> AbstractContextManager:
        dtype = DTYPES[self.train.precision]
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self, with_optimizer: bool = True) -> dict[str, Any]:
        """Without the optimizer's state where it is sharded (FSDP2): every rank saves its shards of it."""
        optimizer = {"optimizer": self.optimizer.state_dict()} if with_optimizer else {}
        return optimizer | {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "optimizer" in state:  # else loaded from the checkpoint's shards
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])


def batches_per_epoch(train_rows: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Each worker's batches per epoch: every data path gives every worker train_rows // world_size rows."""
    rows = train_rows // world_size
    return rows // batch_size if drop_last else math.ceil(rows / batch_size)


def optimizer_steps(micro_batches: int, grad_accum_steps: int) -> int:
    return math.ceil(micro_batches / grad_accum_steps)


def build_optimizer(model: torch.nn.Module, train: TrainSettings) -> torch.optim.Optimizer:
    """Weight decay on matrices and kernels only: biases and normalization scales are not decayed.

    Fused kernels (one kernel updates every parameter) where torch has them for the parameters' device:
    AdamW and SGD on CPU and CUDA. On this 2-core CPU, for the benchmark MLP's 670k parameters, a fused
    AdamW step takes a third of the default's time (0.46 ms against 1.37 ms; SGD with momentum 0.25
    against 0.54), while foreach, torch's default on CUDA, is no faster than the default loop on CPU.
    Elsewhere, torch's default. The choice is in the optimizer's state dict (its param groups): a
    resumed run keeps the implementation it started with (each rounds differently), and a checkpoint
    written before fused kernels were chosen loads as it was."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    # Sharded (FSDP2: DTensors), torch has a fused AdamW and no fused SGD (no sharding rule for it).
    fused = {"fused": True} if fused and (train.optimizer == "adamw" or not _sharded(params)) else {}
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum, **fused)
    return torch.optim.AdamW(groups, lr=train.lr, **fused)


def _sharded(params: list[torch.nn.Parameter]) -> bool:
    return any(hasattr(p, "to_local") for p in params)  # DTensors


def lr_factor(step: int, train: TrainSettings, steps_per_epoch: int) -> float:
    """The multiplier of train.lr for optimizer step `step` (0-based): linear warmup over
    train.warmup_steps, then the schedule."""
    warmup = train.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if train.lr_schedule == "cosine":
        total = max(1, train.epochs * steps_per_epoch - warmup)
        progress = min(step - warmup, total) / total
        return 0.5 * (1 + math.cos(math.pi * progress))
    if train.lr_schedule == "step":
        return train.lr_step_gamma ** (step // (train.lr_step_epochs * steps_per_epoch))
    return 1.0
