"""The image_folder job on the same image files, read three ways (bench/streaming.py):

    stream       the job as it is: raytrain_ddp.data.stream.ImageFolder, read, decoded and augmented by Ray
                 Data tasks while training goes
    memory       every image decoded once on the driver into a materialized Ray Dataset, the same
                 augmentation in a lazy map_batches every epoch (Ray Train's usual ingest)
    dataloader   a map-style torch Dataset that decodes and augments in __getitem__, in
                 train.num_loader_workers DataLoader processes per worker

The model, loss, evaluation, decoding and augmentation are the job's own (jobs/image_folder.py).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import ray.data
import torch
from torch.utils.data import Dataset

from raytrain_ddp.config import recipe
from raytrain_ddp.data import stream

_job = recipe.load("image_folder")
build_model, compute_loss, evaluate, model_input = _job.build_model, _job.compute_loss, _job.evaluate, _job.model_input


def build_datasets(
    *, seed: int, path: str, kind: Literal["stream", "memory", "dataloader"] = "stream", size: int = 16
) -> dict:
    job = _job.build_datasets(seed=seed, path=path, prepare="none", size=(size, size))
    if kind == "stream":
        return job
    listed = {split: s.listed(max_bad_files=0) for split, s in job.items()}
    if kind == "dataloader":
        return {split: Files(s) for split, s in listed.items()}
    untransformed = {split: dataclasses.replace(s, transform=None) for split, s in listed.items()}
    rows = {split: s.example(s.manifest.total, seed) for split, s in untransformed.items()}  # every image, decoded
    memory = {
        split: ray.data.from_items([{"image": i, "label": lb} for i, lb in zip(r["image"], r["label"])]).materialize()
        for split, r in rows.items()
    }
    augment = listed["train"].transform
    return {"train": memory["train"].map_batches(_augmented, fn_args=(augment,)), "val": memory["val"]}


def _augmented(batch: dict, augment) -> dict:
    rng = np.random.default_rng()
    rows = [augment({"image": image, "label": label}, rng) for image, label in zip(batch["image"], batch["label"])]
    return {"image": np.stack([row["image"] for row in rows]), "label": batch["label"]}


class Files(Dataset):
    """The listed files, each decoded (and, for training, augmented) when a DataLoader asks for it."""

    def __init__(self, images: stream.ImageFolder):
        self.images = images

    def __len__(self) -> int:
        return self.images.manifest.total

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        m = self.images.manifest
        row = {k: v[0] for k, v in self.images.read(m.files[i], 0, 1, int(m.labels[i])).items()}
        if self.images.transform is not None:
            row = self.images.transform(row, np.random.default_rng())
        return {"image": torch.from_numpy(np.array(row["image"])), "label": torch.tensor(row["label"])}
