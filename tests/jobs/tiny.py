"""A tiny recipe for the DDP-practice tests: an MLP on a generated regression table whose size the
test chooses, served through Ray Data or as a torch Dataset.

The table does not depend on `seed` (so runs with different seeds see the same rows); `seed` still
drives the model's initialization, the shuffle and dropout, through the service.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import ray.data
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class MLP(nn.Module):
    def __init__(self, dropout: float, unused_branch: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))
        # Parameters that never get a gradient: DDP needs find_unused_parameters=true for them.
        self.unused = nn.Linear(4, 1) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(1)


def build_model(*, dropout: float = 0.0, unused_branch: bool = False) -> nn.Module:
    return MLP(dropout, unused_branch)


class Rows(Dataset):
    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def build_datasets(*, seed: int, rows: int = 64, val_rows: int = 15, source: Literal["ray", "torch"] = "ray"):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(rows + val_rows, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32) + 0.1 * rng.normal(size=len(x))).astype(np.float32)
    splits = {"train": (x[:rows], y[:rows]), "val": (x[rows:], y[rows:])}
    if source == "torch":
        return {name: Rows(*arrays) for name, arrays in splits.items()}
    return {name: ray.data.from_items([{"x": a, "y": b} for a, b in zip(*arrays)]).materialize() for name, arrays in splits.items()}


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    return {"mse": (F.mse_loss(model(batch["x"]), batch["y"], reduction="sum"), len(batch["y"]))}


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"]
