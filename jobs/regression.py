"""A plain MLP on a regression table: the simplest job, and the one to copy when writing a new one.

The table is scikit-learn's diabetes set (442 real patients, 10 measurements, a disease-progression
score one year later; it ships inside the package). Ray Data reads and splits it; the model
standardizes the raw features and answers in the target's units, with the training split's
statistics held inside it (build_datasets' `fitted`), so the registered model takes raw rows.

    raytrain-ddp train regression
    raytrain-ddp train regression model.hidden=128 train.epochs=60

A job is five functions (see raytrain_ddp/config/recipe.py). Their keyword arguments are the YAML's `model:`
and `dataset:` keys: their defaults and limits live here, once, and are checked before Ray starts.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import pandas as pd
import ray.data
import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.datasets import load_diabetes
from torch import nn

from raytrain_ddp.layers import Standardize

FEATURES = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


def build_model(
    *,
    fitted: dict,  # the training rows' statistics, from build_datasets
    hidden: Annotated[int, Field(ge=1)] = 64,
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1,
) -> nn.Module:
    """The 10 raw measurements in, a prediction in the target's units out: the network sees features
    and predicts a target standardized with the training split's statistics (`fitted`, from
    build_datasets), held inside the model, so the registered model needs no preprocessing."""
    return nn.Sequential(
        Standardize(fitted["x_mean"], fitted["x_std"]),
        nn.Linear(len(FEATURES), hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, 1),
        Standardize(fitted["y_mean"], fitted["y_std"], invert=True),
        nn.Flatten(0),  # one prediction per row
    )


def build_datasets(*, seed: int, val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2) -> dict[str, Any]:
    """Rows of {"x": the 10 raw features, "y": the target, "baseline_error": the target minus the
    training mean (what predicting the mean gets wrong)}, and the training split's statistics."""
    table = ray.data.from_pandas(load_diabetes(as_frame=True, scaled=False).frame)
    train, val = table.train_test_split(test_size=val_fraction, shuffle=True, seed=seed)
    stats = train.to_pandas()  # a few hundred rows: the statistics are computed on the driver
    mean, std = stats.mean(), stats.std()

    def to_rows(batch: pd.DataFrame) -> dict[str, np.ndarray]:
        y = batch["target"].to_numpy(np.float32)
        return {"x": batch[FEATURES].to_numpy(np.float32), "y": y, "baseline_error": y - mean["target"]}

    fitted = {
        "x_mean": mean[FEATURES].to_numpy(),
        "x_std": std[FEATURES].to_numpy(),
        "y_mean": mean["target"],
        "y_std": std["target"],
    }
    return {
        "train": train.map_batches(to_rows, batch_format="pandas").materialize(),
        "val": val.map_batches(to_rows, batch_format="pandas").materialize(),
        "fitted": fitted,
    }


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """Sums and counts, in the target's units; the service adds them up over every rank's rows and
    divides. The baseline predicts the training mean: a model worth having has a smaller mse."""
    error = model(batch["x"]) - batch["y"]
    n = len(error)
    return {
        "mse": (error.pow(2).sum(), n),
        "mae": (error.abs().sum(), n),
        "baseline_mse": (batch["baseline_error"].pow(2).sum(), n),
    }


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"]
