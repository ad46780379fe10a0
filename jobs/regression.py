"""A plain MLP on a regression table: the simplest job, and the one to copy when writing a new one.

The table is scikit-learn's diabetes set (442 real patients, 10 measurements, a disease-progression
score one year later; it ships inside the package). Ray Data reads it, splits it and standardizes it
with the training split's statistics.

    raytrain-ddp train regression
    raytrain-ddp train regression model.hidden=128 train.epochs=60

A job is five functions (see raytrain_ddp/recipe.py). Their keyword arguments are the YAML's `model:`
and `dataset:` keys: their defaults and limits live here, once, and are checked before Ray starts.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
import pandas as pd
import ray.data
import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.datasets import load_diabetes
from torch import nn

FEATURES = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


def build_model(
    *, hidden: Annotated[int, Field(ge=1)] = 64, dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1
) -> nn.Module:
    return nn.Sequential(
        nn.Linear(len(FEATURES), hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, 1),
    )


def build_datasets(
    *, seed: int, val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
) -> dict[str, ray.data.Dataset]:
    """Rows of {"x": 10 standardized features, "y": standardized target}, standardized with the
    training split's mean and std, so a prediction of 0 is the training mean."""
    table = ray.data.from_pandas(load_diabetes(as_frame=True, scaled=False).frame)
    train, val = table.train_test_split(test_size=val_fraction, shuffle=True, seed=seed)
    stats = train.to_pandas()  # a few hundred rows: the statistics are computed on the driver
    mean, std = stats.mean(), stats.std()

    def standardize(batch: pd.DataFrame) -> dict[str, np.ndarray]:
        scaled = (batch - mean) / std
        return {"x": scaled[FEATURES].to_numpy(np.float32), "y": scaled["target"].to_numpy(np.float32)}

    return {
        "train": train.map_batches(standardize, batch_format="pandas").materialize(),
        "val": val.map_batches(standardize, batch_format="pandas").materialize(),
    }


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).squeeze(1), batch["y"])


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """Sums and counts; the service adds them up over every rank's rows and divides. The baseline
    predicts the training mean (0 after scaling): a model worth having has a smaller mse."""
    error = model(batch["x"]).squeeze(1) - batch["y"]
    n = len(error)
    return {
        "mse": (error.pow(2).sum(), n),
        "mae": (error.abs().sum(), n),
        "baseline_mse": (batch["y"].pow(2).sum(), n),
    }


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"]
