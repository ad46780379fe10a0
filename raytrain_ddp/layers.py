"""Layers a recipe puts in front of (or after) its network so that the model takes the rows its users
have and answers in their units: the registered model then needs no preprocessing (recipe.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Standardize(nn.Module):
    """`(x - mean) / std` per feature, or with `invert`, `x * std + mean` (a prediction back in the
    target's units). The statistics are buffers: saved with every checkpoint and exported with the
    model. The input is cast to their dtype (float32), so raw integer pixels or counts are taken as
    they are."""

    def __init__(self, mean: Any, std: Any, *, invert: bool = False):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.invert = invert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.mean.dtype)
        return x * self.std + self.mean if self.invert else (x - self.mean) / self.std

    def extra_repr(self) -> str:
        return f"features={self.mean.numel()}, invert={self.invert}"
