"""How a worker turns losses into parameter updates: optimizer, LR schedule, mixed precision,
gradient accumulation and clipping, all driven by `train.*` settings.

The loop asks three things of an `Updater`: `autocast()` around the forward pass, `backward(loss, i)`
for the i-th micro-batch of an epoch, and `ready(i)` to know when that micro-batch completes an
optimizer step, which `step()` then takes.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import AbstractContextManager
from typing import Any

import torch

from raytrain_ddp.config import TrainSettings

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Updater:
    def __init__(
        self,
        model: torch.nn.Module,
        ddp_model: torch.nn.Module,
        train: TrainSettings,
        micro_batches_per_epoch: int,
        device: torch.device,
    ):
        self.train, self.device, self.ddp_model = train, device, ddp_model
        self.micro_batches = micro_batches_per_epoch
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, train)
        steps_per_epoch = optimizer_steps(micro_batches_per_epoch, train.grad_accum_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, train, steps_per_epoch)
        )
        # fp16 needs loss scaling against underflow; disabled, the scaler passes everything through.
        self.scaler = torch.amp.GradScaler(device.type, enabled=train.precision == "fp16")

    def autocast(self) -> AbstractContextManager:
        dtype = DTYPES[self.train.precision]
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def sync(self, i: int) -> AbstractContextManager:
        """Around forward and backward of micro-batch `i`: skip DDP's gradient all-reduce on all but the
        last micro-batch of a step (they only accumulate locally)."""
        if self.ready(i) or not hasattr(self.ddp_model, "no_sync"):
            return contextlib.nullcontext()
        return self.ddp_model.no_sync()

    def backward(self, loss: torch.Tensor, i: int) -> None:
        # Each micro-batch's share of the step, so K micro-batches of B average like one batch of K*B.
        self.scaler.scale(loss / self._group_size(i)).backward()

    def ready(self, i: int) -> bool:
        """Whether micro-batch `i` (0-based, in the epoch) is the last of its optimizer step."""
        k = self.train.grad_accum_steps
        return (i + 1) % k == 0 or i + 1 >= self.micro_batches

    def step(self) -> torch.Tensor:
        """Unscale, clip by global norm, step, advance the schedule; returns the gradient norm before
        clipping, as a tensor on the device (reading it would wait for the GPU), inf or nan when fp16
        overflowed: the scaler then skips the step, and so does the schedule."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.train.grad_clip_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if scale is None or self.scaler.get_scale() >= scale:  # a lowered scale means a skipped step
            self.scheduler.step()
        return norm.detach()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])

    def _group_size(self, i: int) -> int:
        k = self.train.grad_accum_steps
        start = i - i % k
        return max(1, min(k, self.micro_batches - start))


def optimizer_steps(micro_batches: int, grad_accum_steps: int) -> int:
    return math.ceil(micro_batches / grad_accum_steps)


def build_optimizer(model: torch.nn.Module, train: TrainSettings) -> torch.optim.Optimizer:
    """Weight decay on matrices and kernels only: biases and normalization scales are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum)
    return torch.optim.AdamW(groups, lr=train.lr)


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
