"""A table in Parquet shards, streamed: an MLP classifier trained on rows that Ray Data reads while
training goes (never all in memory), only the columns it needs, from a local path, NFS or s3://.

The shards are the `*.parquet` files under `<dataset.path>/train` and `<dataset.path>/val`: a
`features` column holding each row's numbers as a list of one length (float), and a `label` column
(int, 0 ... num_classes - 1); other columns are never read. `dataset.prepare: digits` first writes
scikit-learn's 1,797 handwritten digits there in that form (64 pixel values a row, in 8 shards a
split, with an id and a source column beside them), where the path has no train folder yet.

    raytrain-ddp train parquet_table                                     # digits as Parquet shards, written first
    raytrain-ddp train parquet_table dataset.path=s3://bucket/table dataset.prepare=none

The data decides the model's shape (`derive_settings`): model.num_features is the length of the first
row's features, model.num_classes the largest label plus one (the footers' statistics); name the
classes with data.class_names=[...] to register their names with the model.

Each shard's footer gives its rows; within each worker's share, rows are shuffled in windows of
train.local_shuffle_buffer_size (raytrain_ddp/data/stream.py). The model standardizes its input with the
mean and standard deviation of the first shard's rows (build_datasets' `fitted`), so the registered
model takes raw feature vectors.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from raytrain_ddp import stream
from raytrain_ddp.layers import Standardize

COLUMNS = ("features", "label")


def build_model(
    *,
    fitted: dict,  # the features' statistics, from build_datasets
    num_features: Annotated[int, Field(ge=1)] = 64,
    num_classes: Annotated[int, Field(ge=2)] = 10,
    hidden: Annotated[int, Field(ge=1)] = 128,
) -> nn.Module:
    return nn.Sequential(
        Standardize(fitted["mean"], fitted["std"]),
        nn.Linear(num_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def derive_settings(*, path: str, prepare: str) -> dict:
    """What the shards decide, read before Ray starts: the features' length (the first row's) and one
    output per label, 0 ... the largest (the footers' statistics)."""
    if prepare == "digits":
        write_digits(path)
    train = stream.Parquet(f"{path}/train", columns=COLUMNS)
    lowest, highest = train.column_range("label")
    if lowest < 0:
        raise ValueError(f"{path}/train: labels must be 0 ... num_classes - 1, found {lowest}")
    return {"model.num_features": len(train.first_rows(1)["features"][0]), "model.num_classes": int(highest) + 1}


def build_datasets(*, seed: int, path: str, prepare: Literal["digits", "none"] = "digits") -> dict:
    """The shards under `path`/train and `path`/val, only their features and label columns; and the
    features' statistics, from the first training shard."""
    if prepare == "digits":
        write_digits(path)
    train = stream.Parquet(f"{path}/train", columns=COLUMNS)
    return {"train": train, "val": stream.Parquet(f"{path}/val", columns=COLUMNS), "fitted": _statistics(train)}


def _statistics(shards: stream.Parquet) -> dict[str, np.ndarray]:
    features = shards.first_rows(1024)["features"].astype(np.float64)
    return {"mean": features.mean(axis=0), "std": features.std(axis=0) + 1e-6}


def write_digits(path: str, shards: int = 8) -> None:
    """scikit-learn's digits as Parquet shards under `path`/{train,val}/, unless `path` holds a train
    folder already; a fifth of the rows (by a hash of the row's index) in val."""
    root = Path(path).expanduser()
    if "://" in path or (root / "train").exists():
        return
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    digits = load_digits()
    index = np.arange(len(digits.target))
    in_val = np.array([zlib.crc32(str(i).encode()) % 5 == 0 for i in index])
    for split, rows in (("train", index[~in_val]), ("val", index[in_val])):
        (root / split).mkdir(parents=True, exist_ok=True)
        for k, part in enumerate(np.array_split(rows, shards)):
            table = pa.table(
                {
                    "id": part,
                    "features": list(digits.data[part].astype(np.float32)),
                    "label": digits.target[part].astype(np.int64),
                    "source": ["sklearn.datasets.load_digits"] * len(part),
                }
            )
            pq.write_table(table, root / split / f"part-{k:03d}.parquet")


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["features"]), batch["label"])


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    logits = model(batch["features"])
    n = len(batch["label"])
    return {
        "loss": (F.cross_entropy(logits, batch["label"], reduction="sum"), n),
        "accuracy": ((logits.argmax(dim=1) == batch["label"]).sum(), n),
    }


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["features"]
