"""FashionMNIST with a ResNet-18, read through Ray Data: Ray Train's canonical computer-vision example.

The data is the standard FashionMNIST IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte,
t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte; gzipped or not) under `dataset.path`, a directory on
storage every node can read (a local path, NFS, or s3://...). `dataset.download: true` fetches them
with torchvision into that path first, on the driver, once (local paths only).

    raytrain-ddp train fashion_mnist dataset.path=/data/fashion-mnist dataset.download=true
    raytrain-ddp train fashion_mnist dataset.path=s3://bucket/fashion-mnist scaling.num_workers=4
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow.fs
import ray.data
import torch
import torch.nn.functional as F
import torchvision
from pydantic import Field
from torch import nn

from raytrain_ddp.layers import Standardize

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MEAN, STD = 0.2860 * 255, 0.3530 * 255  # of FashionMNIST's training pixels (0..255)


def build_model(*, num_classes: Annotated[int, Field(ge=2)] = 10) -> nn.Module:
    """Raw 28x28 uint8 images in, as the IDX files hold them, normalized and given their channel
    inside the model; then torchvision's ResNet-18 with a 1-channel stem, as in Ray Train's
    FashionMNIST example."""
    resnet = torchvision.models.resnet18(num_classes=num_classes)
    resnet.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return nn.Sequential(Standardize(MEAN, STD), nn.Unflatten(1, (1, 28)), resnet)  # (N, 28, 28) -> (N, 1, 28, 28)


def build_datasets(
    *, seed: int, path: str, download: bool = False, limit: Annotated[int, Field(ge=1)] | None = None
) -> dict[str, ray.data.Dataset]:
    """Rows of {"image": (28, 28) uint8, as in the files, "label": int64}; `limit` keeps the first
    rows of each split (a quick try). The official train/test files are the train/val splits, so
    `seed` does not change them."""
    if download:
        _download(path)
    return {split: _read_split(path, *names, limit) for split, names in FILES.items()}


def _download(path: str) -> None:
    if "://" in path:
        raise ValueError(f"dataset.download needs a local dataset.path, got {path}; upload the files there yourself")
    for train in (True, False):  # skips files that are already there
        torchvision.datasets.FashionMNIST(root=path, train=train, download=True)


def _read_split(path: str, images_name: str, labels_name: str, limit: int | None) -> ray.data.Dataset:
    images = _read_idx(_find(path, images_name))
    labels = _read_idx(_find(path, labels_name))
    if len(images) != len(labels):
        raise ValueError(f"{images_name} has {len(images)} images but {labels_name} has {len(labels)} labels")
    images, labels = images[:limit], labels[:limit]
    # Ray Data holds the raw uint8 rows: the model normalizes them (so does the registered model).
    return ray.data.from_items(
        [{"image": image, "label": np.int64(label)} for image, label in zip(images, labels)]
    ).materialize()


def _find(path: str, name: str) -> str:
    """`name` or `name.gz` in `path` or in `path/FashionMNIST/raw` (where torchvision downloads)."""
    candidates = [
        f"{d}/{name}{gz}" for d in (path.rstrip("/"), f"{path.rstrip('/')}/FashionMNIST/raw") for gz in ("", ".gz")
    ]
    for candidate in candidates:
        fs, fs_path = _filesystem(candidate)
        if fs.get_file_info(fs_path).is_file:
            return candidate
    raise FileNotFoundError(
        f"dataset.path={path}: no {name} (or {name}.gz) there or in FashionMNIST/raw below it; "
        f"point dataset.path at the FashionMNIST IDX files, or set dataset.download=true"
    )


def _read_idx(uri: str) -> np.ndarray:
    """An IDX file (the MNIST format): 0, 0, a type byte (8 = uint8), the number of dimensions, each
    dimension as a big-endian int32, then the data."""
    fs, fs_path = _filesystem(uri)
    with fs.open_input_stream(fs_path) as f:  # decompresses .gz by its extension
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{uri} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{uri} is truncated: header says {shape}, found {data.size} values")
    return data.reshape(shape)


def _filesystem(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    if "://" in uri:
        return pyarrow.fs.FileSystem.from_uri(uri)
    return pyarrow.fs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["image"]), batch["label"])


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    logits = model(batch["image"])
    n = len(batch["label"])
    return {
        "loss": (F.cross_entropy(logits, batch["label"], reduction="sum"), n),
        "accuracy": ((logits.argmax(dim=1) == batch["label"]).sum(), n),
    }


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["image"]
