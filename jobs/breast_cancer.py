"""Breast-cancer classification: an MLP on a tabular set (scikit-learn's Wisconsin diagnostic data,
569 real tumours, 30 measurements, malignant or benign; it ships inside the package).

With the YAML's defaults (2 workers, batch 8 per worker, drop_last) an epoch over the 455-row
training split is 227 rows per worker, 28 batches each, 56 in all, 448 samples: every report carries
`train_samples`, `train_samples_per_worker` and `train_batches`, so these counts can be checked.

    raytrain-ddp train breast_cancer
    raytrain-ddp train breast_cancer train.batch_size=16 model.hidden=128
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import pandas as pd
import ray.data
import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.datasets import load_breast_cancer
from torch import nn

from raytrain_ddp.layers import Standardize

_DATA = load_breast_cancer(as_frame=True)
FEATURES = list(_DATA.feature_names)


def build_model(
    *,
    fitted: dict,  # {"mean": ..., "std": ...} of the training rows, from build_datasets
    hidden: Annotated[int, Field(ge=1)] = 64,
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.2,
) -> nn.Module:
    """The 30 raw measurements in, standardized inside the model with the training split's statistics
    (`fitted`, from build_datasets)."""
    return nn.Sequential(
        Standardize(fitted["mean"], fitted["std"]),
        nn.Linear(len(FEATURES), hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden // 2),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden // 2, 2),
    )


def build_datasets(*, seed: int, val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2) -> dict[str, Any]:
    """Rows of {"x": the 30 raw measurements, "y": 0 malignant / 1 benign}, and the training split's
    mean and std of each measurement (`fitted`: the model standardizes with them)."""
    table = ray.data.from_pandas(_DATA.frame)
    train, val = table.train_test_split(test_size=val_fraction, shuffle=True, seed=seed)
    stats = train.to_pandas()[FEATURES]  # a few hundred rows: the statistics are computed on the driver
    return {
        "train": train.map_batches(_to_rows, batch_format="pandas").materialize(),
        "val": val.map_batches(_to_rows, batch_format="pandas").materialize(),
        "fitted": {"mean": stats.mean().to_numpy(), "std": stats.std().to_numpy()},
    }


def _to_rows(batch: pd.DataFrame) -> dict[str, np.ndarray]:
    return {"x": batch[FEATURES].to_numpy(np.float32), "y": batch["target"].to_numpy(np.int64)}


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    logits = model(batch["x"])
    n = len(batch["y"])
    return {
        "loss": (F.cross_entropy(logits, batch["y"], reduction="sum"), n),
        "accuracy": ((logits.argmax(dim=1) == batch["y"]).sum(), n),
    }


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"]
