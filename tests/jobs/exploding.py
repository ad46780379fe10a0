"""A test recipe whose training loss is infinite: a run of it must stop with an error and register nothing.

Evaluation stays finite, so the driver's check of the recipe on two rows passes and the failure
happens where a real divergence would: in the workers, during training.
"""

from __future__ import annotations

import numpy as np
import ray.data
import torch
import torch.nn.functional as F
from torch import nn


def build_model() -> nn.Module:
    return nn.Linear(4, 2)


def build_datasets(*, seed: int) -> dict[str, ray.data.Dataset]:
    rng = np.random.default_rng(seed)
    rows = ray.data.from_numpy(rng.normal(size=(64, 4)).astype(np.float32)).map_batches(
        lambda b: {"x": b["data"], "y": (b["data"][:, 0] > 0).astype(np.int64)}
    )
    return {"train": rows.materialize(), "val": rows.materialize()}


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    return loss * float("inf") if model.training else loss


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    return {"loss": (F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum"), len(batch["y"]))}


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"]
