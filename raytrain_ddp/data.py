"""Ray Data: which dataset is split how, and how a worker turns its share into torch batches.

- `train` is split across the workers (`streaming_split(equal=True)`: the same number of rows each, up
  to world_size - 1 rows dropped an epoch). Its order is a function of (seed, epoch): `preserve_order`
  makes the split deterministic and each worker reshuffles its shard with a seed drawn from
  (seed, epoch, rank), so a resumed run sees exactly the batches an uninterrupted one would.
- `val` is not split: every worker reads all of it in the same order and evaluates only the batches
  `i` with `i % world_size == rank`, so each row is counted exactly once across ranks.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Iterator, Mapping

import numpy as np
import ray.data
import torch
from ray.train import DataConfig

DATASETS = ("train", "val")


def check_datasets(datasets: Any, job: str) -> dict[str, ray.data.Dataset]:
    """The recipe's build_datasets must return exactly {"train": Dataset, "val": Dataset}."""
    if not isinstance(datasets, Mapping) or set(datasets) != set(DATASETS):
        got = sorted(datasets) if isinstance(datasets, Mapping) else type(datasets).__name__
        raise TypeError(f"job '{job}': build_datasets must return a dict with keys {list(DATASETS)}, got {got}")
    for name, ds in datasets.items():
        if not isinstance(ds, ray.data.Dataset):
            raise TypeError(f"job '{job}': build_datasets()['{name}'] must be a ray.data.Dataset, got {type(ds).__name__}")
    return dict(datasets)


def dataset_config() -> DataConfig:
    # The context's options (resource limits, ...), plus a fixed order. Copied rather than rebuilt with
    # DataConfig.default_ingest_options(), which sets a deprecated option and warns on every run.
    options = copy.deepcopy(ray.data.DataContext.get_current().execution_options)
    options.preserve_order = True
    return DataConfig(datasets_to_split=["train"], execution_options=options)


def steps_per_epoch(train_rows: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    rows = train_rows // world_size  # what streaming_split(equal=True) gives each worker
    return rows // batch_size if drop_last else math.ceil(rows / batch_size)


def derive_seed(seed: int, *keys: int) -> int:
    """An independent 32-bit seed for each (seed, *keys): one per purpose, epoch and rank."""
    return int(np.random.SeedSequence(seed, spawn_key=keys).generate_state(1)[0])


SHUFFLE, WORKER_RNG = 0, 1  # the purposes derive_seed serves


def train_batches(
    shard: ray.data.DataIterator,
    *,
    batch_size: int,
    drop_last: bool,
    shuffle_buffer: int,
    seed: int,
    epoch: int,
    rank: int,
    device: torch.device,
) -> Iterator[dict[str, torch.Tensor]]:
    return shard.iter_torch_batches(
        batch_size=batch_size,
        drop_last=drop_last,
        local_shuffle_buffer_size=shuffle_buffer or None,
        local_shuffle_seed=derive_seed(seed, SHUFFLE, epoch, rank) if shuffle_buffer else None,
        device=device,
    )


def val_batches(
    shard: ray.data.DataIterator, *, batch_size: int, rank: int, world_size: int, device: torch.device
) -> Iterator[dict[str, torch.Tensor]]:
    for i, batch in enumerate(shard.iter_torch_batches(batch_size=batch_size, device=device)):
        if i % world_size == rank:
            yield batch
