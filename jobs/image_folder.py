"""Images in class folders, streamed: a ResNet-18 trained on image files that Ray Data reads, decodes and
augments while training goes (never all in memory), from a local path, NFS or s3://.

The layout is `<dataset.path>/train/<class>/<image>` and `<dataset.path>/val/<class>/<image>` (PNG,
JPEG, ...; classes in sorted order are labels 0, 1, ...). The data decides the model's outputs (one per
class folder: model.num_classes, and data.class_names, registered with the model) and its input channels
(model.channels, from dataset.grayscale): `derive_settings`. `dataset.prepare: digits` first writes
scikit-learn's 1,797 handwritten digits there as PNG files in that layout, where the path has none
yet, so the job runs on a fresh machine; `prepare: none` trains on what is there (FashionMNIST or
ImageNet exported as image files, say).

    raytrain-ddp train image_folder                                   # digits as PNG files, written first
    raytrain-ddp train image_folder dataset.path=s3://bucket/images dataset.prepare=none \\
        dataset.size=[224,224] dataset.grayscale=false scaling.use_gpu=true

Training images get a random crop (after `crop_padding` pixels of reflection) and a horizontal flip
(`flip`), drawn from a generator seeded by (seed, epoch, image): the same in every run with the
same seed. The registered model takes the decoded images as uint8 (N, H, W) or (N, H, W, 3).
"""

from __future__ import annotations

import zlib
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from pydantic import Field
from torch import nn

from raytrain_ddp import stream
from raytrain_ddp.layers import Standardize


class ChannelsFirst(nn.Module):
    """uint8 images (N, H, W) or (N, H, W, C), as decoded, to float (N, C, H, W)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = images.float()
        return images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)


def build_model(
    *, num_classes: Annotated[int, Field(ge=2)] = 10, channels: Literal[1, 3] = 1, small_images: bool = True
) -> nn.Module:
    """torchvision's ResNet-18 on `channels` channels. `small_images` (up to ~64 pixels a side) gives it
    a CIFAR-style stem (3x3 stride-1 convolution, no max-pool) so that small images keep their feature
    maps; else ImageNet's stem. Pixels are normalized inside the model, which then takes raw images."""
    resnet = torchvision.models.resnet18(num_classes=num_classes)
    if small_images:
        resnet.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        resnet.maxpool = nn.Identity()
    elif channels != 3:
        resnet.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return nn.Sequential(ChannelsFirst(), Standardize(127.5, 64.0), resnet)


def derive_settings(*, path: str, prepare: str, grayscale: bool) -> dict:
    """What the images decide, read before Ray starts: one output per class folder under `path`/train,
    named by it, and the channels `grayscale` gives."""
    if prepare == "digits":
        write_digits(path)
    classes = stream.ImageFolder(f"{path}/train").class_names()
    return {"model.num_classes": len(classes), "model.channels": 1 if grayscale else 3, "data.class_names": classes}


def build_datasets(
    *,
    seed: int,
    path: str,
    prepare: Literal["digits", "none"] = "digits",
    size: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] = (16, 16),
    grayscale: bool = True,
    crop_padding: Annotated[int, Field(ge=0)] = 2,
    flip: bool = False,
) -> dict[str, stream.ImageFolder]:
    """The images under `path`/train and `path`/val, each decoded, converted to grayscale or RGB and
    resized to `size` (height, width); training images augmented (see the module's docstring)."""
    if prepare == "digits":
        write_digits(path)
    images = partial(stream.ImageFolder, size=tuple(size), mode="L" if grayscale else "RGB")
    train = images(f"{path}/train", transform=partial(random_crop_flip, padding=crop_padding, flip=flip))
    return {"train": train, "val": images(f"{path}/val", classes=train.class_names())}


def random_crop_flip(row: dict[str, np.ndarray], rng: np.random.Generator, padding: int, flip: bool) -> dict:
    """A random crop of the image padded by reflection, then (if `flip`) a horizontal flip, half the time."""
    image = row["image"]
    h, w = image.shape[:2]
    if padding:
        pad = ((padding, padding), (padding, padding)) + ((0, 0),) * (image.ndim - 2)
        top, left = rng.integers(0, 2 * padding + 1, size=2)
        image = np.pad(image, pad, mode="reflect")[top : top + h, left : left + w]
    if flip and rng.random() < 0.5:
        image = image[:, ::-1]
    return {"image": np.ascontiguousarray(image), "label": row["label"]}


def write_digits(path: str) -> None:
    """scikit-learn's digits as 8x8 grayscale PNG files under `path`/{train,val}/<digit>/, unless
    `path` holds a train folder already; a fifth of them (by a hash of the image's index) in val."""
    root = Path(path).expanduser()
    if "://" in path or (root / "train").exists():
        return
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if zlib.crc32(str(i).encode()) % 5 == 0 else "train"
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((pixels * 16).clip(0, 255).astype(np.uint8), mode="L").save(folder / f"{i:04d}.png")


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
