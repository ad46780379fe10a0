"""The data a worker trains on: a recipe's datasets, how they are split across ranks, and how a rank
turns its share into torch batches. A recipe returns Ray Datasets, torch Datasets, or streams of files
(`raytrain_ddp.data.stream`: read while training goes, never materialized; that module says how).

Ray Datasets (the usual way; read and preprocessed by Ray Data):
- materialized (as the shipped jobs leave them): their blocks are already in the object store, so
  each rank reads its share of them itself (`stream.Blocks`), planned as a stream's files are: the
  blocks in an order seeded by (seed, epoch), rank r trains rows [r*n, (r+1)*n) of that sequence
  (n = rows // world_size: up to world_size - 1 rows dropped an epoch), shuffled in windows of
  `train.local_shuffle_buffer_size` rows seeded by (seed, epoch, rank, window) (with
  `train.group_by_length`, each window's rows then grouped into batches of similar length, the batches'
  order seeded by (seed, epoch, window), the same on every rank: epoch.by_length); a resumed epoch starts
  at the window of its first untrained batch, and trains the batches an uninterrupted one would.
  `val` in contiguous ranges, each row counted once. No Ray Data execution, no split coordinator, no
  dataset manager: the processes those start cost a run's start seconds on a small machine.
- lazy (a pipeline still to run): Ray Train's Ray Data path. `train` is split across the workers
  (`streaming_split(equal=True)`: the same number of rows each, up to world_size - 1 rows dropped an
  epoch). Its order is a function of (seed, epoch): `preserve_order` makes the split deterministic and
  each worker reshuffles its shard with a seed drawn from (seed, epoch, rank), so a resumed run sees
  exactly the batches an uninterrupted one would. `val` is not split: every worker reads all of it in
  the same order and evaluates only the batches `i` with `i % world_size == rank`, so each row is
  counted exactly once across ranks.

torch Datasets (map-style, shipped to each worker with the loop): `train` goes through a
DistributedSampler seeded by (seed), reshuffled per epoch with `set_epoch`, dropping the same tail
rows as the Ray path; `val` is strided by row, `rank, rank + world_size, ...`, so again each row is
counted once (a DistributedSampler would pad it with repeats). `prepare_data_loader` moves batches to
the device, with pinned memory and non-blocking copies on a GPU.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray.data
import ray.train
import ray.train.torch
import torch
from ray.train import DataConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, default_collate

from raytrain_ddp.config.schema import DataSettings, TrainSettings
from raytrain_ddp.data import pipeline, stream
from raytrain_ddp.data.seeds import LOADER, SHUFFLE, derive_seed

DATASETS = ("train", "val")
FITTED = "fitted"  # build_datasets' optional third entry: statistics of the training rows, for build_model
# Rows a worker takes from Ray Data at a time (at least one batch), then cuts into training batches on
# the device: Ray Data's iterator threads cost about the same per batch whatever its size, and on a
# machine of few cores they take CPU from training. A local shuffle buffer smaller than this is rounded
# up to it.
FETCH_ROWS = 512


def check_datasets(datasets: Any, job: str) -> tuple[dict[str, ray.data.Dataset | Dataset], Any]:
    """build_datasets must return {"train": ..., "val": ...}: both Ray Datasets, both map-style torch
    Datasets or both streams; and may add "fitted" (what it learnt from the training rows, for
    build_model).
    Returns the datasets and what was fitted (None if nothing)."""
    if not isinstance(datasets, Mapping) or set(datasets) - {FITTED} != set(DATASETS):
        got = sorted(datasets) if isinstance(datasets, Mapping) else type(datasets).__name__
        raise TypeError(
            f"job '{job}': build_datasets must return a dict with keys {list(DATASETS)} (and optionally "
            f"'{FITTED}'), got {got}"
        )
    datasets = dict(datasets)
    fitted = datasets.pop(FITTED, None)
    kinds = {name: _kind(ds) for name, ds in datasets.items()}
    if None in kinds.values() or len(set(kinds.values())) != 1:
        got = ", ".join(f"{name}: {type(ds).__name__}" for name, ds in datasets.items())
        raise TypeError(
            f"job '{job}': build_datasets must return two ray.data.Dataset, two map-style torch "
            f"Datasets (with __len__ and __getitem__) or two raytrain_ddp.data.stream datasets, got {got}"
        )
    return datasets, fitted


def _kind(dataset: Any) -> str | None:
    if isinstance(dataset, ray.data.Dataset):
        return "ray"
    if isinstance(dataset, Dataset) and hasattr(dataset, "__len__"):
        return "torch"
    if isinstance(dataset, stream.Stream):
        return "stream"
    return None


def is_ray(datasets: Mapping[str, Any]) -> bool:
    return isinstance(datasets["train"], ray.data.Dataset)


def is_stream(datasets: Mapping[str, Any]) -> bool:
    return isinstance(datasets["train"], stream.Stream)


def listed(datasets: Mapping[str, Any]) -> dict[str, str]:
    """For streams, what listing found, as MLflow params: the files of each dataset. (The unreadable
    ones skipped are known only once training has read them all: `skipped`.)"""
    if not is_stream(datasets):
        return {}
    return {f"data.{name}_files": str(len(s.manifest.files)) for name, s in datasets.items()}


def skipped(datasets: Mapping[str, Any], read: Iterable[str]) -> list[str]:
    """Every file a run of streams left out as unreadable (data.max_bad_files), a line each: those
    listing found (any dataset), then those the ranks found reading the training files (`read`, the
    last epoch's report)."""
    if not is_stream(datasets):
        return []
    found = [f"{name}: {entry}" for name, s in datasets.items() for entry in s.manifest.skipped]
    return found + [f"train: {path}: unreadable when read" for path in sorted(read)]


def shipped(datasets: Mapping[str, Any]) -> dict[str, Any] | None:
    """What travels to the workers with the loop: torch Datasets and streams as they are, materialized
    Ray Datasets as their blocks in the object store (`stream.Blocks`: each rank reads its share itself).
    None where Ray Train's Ray Data path reads them (a lazy Ray Dataset: its pipeline runs as training
    goes)."""
    if not is_ray(datasets):
        return dict(datasets)
    blocks = {name: stream.Blocks.of(dataset) for name, dataset in datasets.items()}
    return None if None in blocks.values() else blocks


def num_rows(dataset: ray.data.Dataset | Dataset | stream.Stream) -> int:
    if isinstance(dataset, stream.Stream):
        return dataset.manifest.total
    return dataset.count() if isinstance(dataset, ray.data.Dataset) else len(dataset)


def example_batch(
    dataset: ray.data.Dataset | Dataset | stream.Stream, seed: int, n: int = 2
) -> dict[str, torch.Tensor]:
    """The first `n` rows as a CPU batch: what the pre-flight check and the MLflow signature use."""
    if isinstance(dataset, stream.Stream):
        return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in dataset.example(n, seed).items()}
    if isinstance(dataset, ray.data.Dataset):
        batch = _first_rows(dataset, n) or dataset.take_batch(n, batch_format="numpy")
        return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in batch.items()}
    return default_collate([dataset[i] for i in range(n)])


def fingerprint(dataset: ray.data.Dataset | Dataset | stream.Stream, rows: int, n: int = 8) -> str:
    """What identifies a dataset's rows, for a registered version's lineage: a sha256 over their count,
    the files they were read from and their first `n` rows, each where the driver knows it without
    reading the data again, and what it covers. A stream: its manifest (every file and its rows). A
    Ray Dataset: Ray's `input_files()` where its plan knows them (not past a map, nor once
    materialized), with each local file's size, and a materialized one's first rows from the object
    store (3 ms for digits' training rows; `take` would execute a lazy dataset's pipeline). A torch
    Dataset: its first rows."""
    digest = hashlib.sha256(f"{rows} rows\n".encode())
    covers = [f"{rows} rows"]
    first: Any = None
    if isinstance(dataset, stream.Stream):
        for file, file_rows in zip(dataset.manifest.files, dataset.manifest.rows.tolist()):
            digest.update(f"{file}\t{file_rows}\n".encode())
        covers.append(f"{len(dataset.manifest.files)} files' names and rows")
    elif isinstance(dataset, ray.data.Dataset):
        if files := sorted(dataset.input_files()):  # a set's order: sorted, for the same digest
            for file in files:
                digest.update(f"{file}\t{os.path.getsize(file) if os.path.isfile(file) else '?'}\n".encode())
            covers.append(f"{len(files)} input files' names and sizes")
        first = _first_rows(dataset, min(n, rows))
    else:
        first = [dataset[i] for i in range(min(n, rows))]
    if first is not None:
        _update(digest, first)
        covers.append(f"the first {min(n, rows)}")
    return f"{digest.hexdigest()} ({', '.join(covers)})"


def _update(digest: Any, value: Any) -> None:
    """Hash a row (or a batch) by its contents: columns by name, arrays by dtype, shape and bytes."""
    if isinstance(value, Mapping):
        for key in sorted(value):
            digest.update(str(key).encode())
            _update(digest, value[key])
    elif isinstance(value, list | tuple):
        for item in value:
            _update(digest, item)
    elif isinstance(value, str | bytes | int | float | bool | type(None)):
        digest.update(repr(value).encode())
    else:
        array = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
        if array.dtype == object:
            digest.update(repr(array.tolist()).encode())
        else:
            digest.update(f"{array.dtype.str}{array.shape}".encode() + np.ascontiguousarray(array).tobytes())


def _first_rows(dataset: ray.data.Dataset, n: int) -> dict[str, np.ndarray] | None:
    """A materialized dataset's first `n` rows, read from its blocks in the object store: no
    execution, which would cost the driver seconds (Ray Data's first one starts its executor and
    stats actor) before anything else can start. None where that cannot answer (a lazy dataset)."""
    blocks = stream.Blocks.of(dataset)
    if blocks is None or blocks.manifest.total < n:
        return None
    return blocks.example(n, seed=0)


def dataset_config() -> DataConfig:
    # The context's options (resource limits, ...), plus a fixed order. Copied rather than rebuilt with
    # DataConfig.default_ingest_options(), which sets a deprecated option and warns on every run.
    options = copy.deepcopy(ray.data.DataContext.get_current().execution_options)
    options.preserve_order = True
    return DataConfig(datasets_to_split=["train"], execution_options=options)


def split_batches(
    batches: Iterator[dict[str, torch.Tensor]], size: int, drop_last: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """Cut batches of a multiple of `size` rows (but the last) into consecutive batches of `size` rows,
    views of them; the very last may be short, unless drop_last."""
    for batch in batches:
        rows = len(next(iter(batch.values())))
        for start in range(0, rows, size):
            if drop_last and start + size > rows:
                return
            yield {name: column[start : start + size] for name, column in batch.items()}


class WorkerData:
    """This rank's batches: from the Ray Data shards, or from the torch Datasets or streams shipped
    with the loop (`shipped`)."""

    def __init__(
        self,
        shipped: Mapping[str, Dataset | stream.Stream] | None,
        train: TrainSettings,
        data: DataSettings,
        seed: int,
    ):
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.train, self.seed = train, seed
        self.loaders = self.streams = None
        if shipped is None:
            # Asked for on a thread: the shards come once Ray Train's dataset manager (a new process)
            # has started and split the data, while this rank builds and wraps its model.
            asking = ThreadPoolExecutor(1, thread_name_prefix="shards")
            self._shards = asking.submit(lambda: tuple(map(ray.train.get_dataset_shard, ("train", "val"))))
            asking.shutdown(wait=False)  # its thread ends with the one task
        elif is_stream(shipped):
            share = {"rank": self.rank, "world_size": self.world_size, "seed": seed, "data": data}
            self.streams = {
                "train": pipeline.Pipeline(
                    shipped["train"],
                    batch_size=train.batch_size,
                    shuffle=train.shuffle,
                    shuffle_rows=train.local_shuffle_buffer_size,
                    drop_last=train.drop_last,
                    group_by=train.group_by_length,
                    **share,
                ),
                "val": pipeline.Pipeline(shipped["val"], batch_size=train.eval_batch_size, equal=False, **share),
            }
        else:
            self.loaders = self._loaders(shipped)

    @property
    def reads_files(self) -> bool:
        """Whether this rank's rows come from files (a stream's), some perhaps unreadable."""
        return self.streams is not None and self.streams["train"].stream.read_in_tasks

    @property
    def train_shard(self) -> ray.data.DataIterator:
        return self._shards.result()[0]

    @property
    def val_shard(self) -> ray.data.DataIterator:
        return self._shards.result()[1]

    def stream_read(self) -> tuple[int, set[str]]:
        """A stream's training rows this rank read in the epoch (since the epoch's start, or since the
        point it resumed from), and the files of rows it skipped as unreadable."""
        return self.streams["train"].rows_read, self.streams["train"].bad_files

    def train_batches(self, epoch: int, first: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches of `epoch` from batch `first` on. A stream starts reading there;
        the other paths read the epoch from its start and pass over the first `first` batches."""
        if self.streams is not None:
            return self._on_device(self.streams["train"].batches(epoch, first))
        return itertools.islice(self._train_batches(epoch), first, None)

    def _on_device(self, batches: Iterator[dict[str, np.ndarray]]) -> Iterator[dict[str, torch.Tensor]]:
        for batch in batches:
            yield {name: torch.from_numpy(column).to(self.device, non_blocking=True) for name, column in batch.items()}

    def _train_batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        t = self.train
        if self.loaders is not None:
            loader, sampler, generator = self.loaders["train"]
            sampler.set_epoch(epoch)
            generator.manual_seed(derive_seed(self.seed, LOADER, epoch, self.rank))  # DataLoader workers' seeds
            return iter(loader)
        shuffle_seed = derive_seed(self.seed, SHUFFLE, epoch, self.rank)
        per_fetch = max(1, FETCH_ROWS // t.batch_size)
        fetched = self.train_shard.iter_torch_batches(
            batch_size=t.batch_size * per_fetch,
            local_shuffle_buffer_size=t.local_shuffle_buffer_size if t.shuffle else None,
            local_shuffle_seed=shuffle_seed if t.shuffle else None,
            device=self.device,
        )
        return split_batches(fetched, t.batch_size, t.drop_last)

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.streams is not None:
            yield from self._on_device(self.streams["val"].batches(0))
            return
        if self.loaders is not None:
            yield from self.loaders["val"]
            return
        batches = self.val_shard.iter_torch_batches(batch_size=self.train.eval_batch_size, device=self.device)
        for i, batch in enumerate(batches):
            if i % self.world_size == self.rank:
                yield batch

    def _loaders(self, datasets: Mapping[str, Dataset]) -> dict[str, Any]:
        t, pin = self.train, self.device.type == "cuda"
        sampler = DistributedSampler(
            datasets["train"],
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=t.shuffle,
            seed=derive_seed(self.seed, SHUFFLE),
            drop_last=True,
        )
        generator = torch.Generator()
        train = DataLoader(
            datasets["train"],
            batch_size=t.batch_size,
            sampler=sampler,
            drop_last=t.drop_last,
            num_workers=t.num_loader_workers,
            generator=generator,
            pin_memory=pin,
        )
        val_rows = Subset(datasets["val"], range(self.rank, len(datasets["val"]), self.world_size))
        val = DataLoader(val_rows, batch_size=t.eval_batch_size, num_workers=t.num_loader_workers, pin_memory=pin)
        prepare = ray.train.torch.prepare_data_loader
        return {
            "train": (prepare(train, add_dist_sampler=False), sampler, generator),
            "val": prepare(val, add_dist_sampler=False),
        }
