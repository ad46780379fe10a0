"""The checkpoint format: what a checkpoint holds, how rank 0 writes it, how it is read back.

A checkpoint is a directory:

    model.pt        state_dict of the unwrapped model (never the DDP wrapper's); of a model with frozen
                    parameters (LoRA adapters on a pretrained base), only what trains: the frozen
                    parameters are the recipe's build_model's, rebuilt on load
    train_state.pt  optimizer, LR-schedule and grad-scaler state; where training stands (epochs, steps and
                    micro-batches of the current epoch done); every rank's RNG state and epoch counters
    config.json     the resolved run config
    metrics.json    the metrics reported with it
    manifest.json   size and sha256 of each file above; written last, so no manifest = not a checkpoint

Under FSDP2 (scaling.strategy=fsdp) the model and the optimizer state are sharded: `shards/` holds
torch.distributed.checkpoint's files (`.metadata` and a `__<rank>_0.distcp` of each rank's shards),
every rank writing its own, and there is no model.pt; train_state.pt then holds the rest of the
updater's state. The manifest lists every shard. `Verified.model_state` assembles the whole model
from the shards in one process (registration, comparisons): no process group, no sharded model.

Tensors load with `torch.load(weights_only=True)`: reading a checkpoint never unpickles arbitrary
objects. Reading starts with `open_verified`, which checks the manifest once; `open_first_verified`
walks a run's checkpoints (newest first, or best first) and opens the first that verifies, naming
each one it skipped and why; `open_resume_point` is the one place that decides where a run resumes.
`rank` is the one place that decides which checkpoint is best (the console's ★, registration, the
summary), by the rule Ray Train uses to decide which checkpoints to keep.

Checkpoints are named for where training stood: `epoch_0003` at the end of epoch 3,
`epoch_0004-step_0000450` at step 450, in epoch 4.

A checkpoint is on storage, whole, before its report returns (checkpoint.upload=sync); Ray Train
records it when its controller next polls the workers. A worker that dies in between would take the
report with it: `unrecorded` finds such a checkpoint in the run's directory, and a run resumes from
it when it is newer than Ray's latest and verifies (then `loop.py` reports it again, so that Ray
records it). So training never waits for the controller's poll, and a reported checkpoint is never
lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import random
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
from pyarrow.fs import FileSelector, FileType

from raytrain_ddp.checkpoint import storage

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"
MANIFEST_FILE = "manifest.json"
SHARDS_DIR = "shards"  # FSDP2: torch.distributed.checkpoint's files, every rank's shards
PARTS = (MODEL_FILE, STATE_FILE, CONFIG_FILE, METRICS_FILE)
SHARDED_PARTS = (STATE_FILE, CONFIG_FILE, METRICS_FILE)  # rank 0's, beside every rank's shards
FILES = (*PARTS, MANIFEST_FILE)  # in the order they are written and uploaded: the manifest last
MID_EPOCH = "mid-epoch"  # why a checkpoint of another number of workers is passed over (`resumable_on`)


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or corrupt."""


class NoValidCheckpoint(CheckpointError):
    """A run has checkpoints, and not one of them verifies (or is resumable on this number of workers)."""

    def __init__(self, message: str, skipped: list[Skipped] | None = None):
        super().__init__(message)
        self.skipped = skipped or []


@dataclass(frozen=True)
class TrainingState:
    epoch: int  # epochs completed
    step: int  # optimizer steps completed
    updater: dict[str, Any]  # optimizer, scheduler and scaler state, from `optim.Updater.state_dict()`
    rng: list[dict[str, Any]]  # one per world rank, from `rng_state()`
    batches: int = 0  # micro-batches of epoch `epoch + 1` already trained; 0 at the end of an epoch
    meters: list[dict[str, Any]] = field(default_factory=list)  # per rank, mid-epoch: `metrics.EpochMeter` fields
    early_stopping: dict[str, Any] = field(default_factory=dict)  # `EarlyStopping.state_dict()`: {} before it existed


def dir_name(epoch: int, step: int, batches: int) -> str:
    """`epoch_0003` after epoch 3; `epoch_0004-step_0000450` at step 450, `batches` into epoch 4."""
    return f"epoch_{epoch:04d}" if batches == 0 else f"epoch_{epoch + 1:04d}-step_{step:07d}"


_NAME = re.compile(r"epoch_(\d+)(?:-step_(\d+))?(?:-retrained)?")


def position(name: str) -> tuple[int, int, int] | None:
    """Where training stood at the checkpoint named `name`, in an order that grows with training
    (None: not a checkpoint's name): a mid-epoch checkpoint of epoch 4 comes before `epoch_0004`."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    epoch, step = int(match.group(1)), match.group(2)
    return (epoch, 1, 0) if step is None else (epoch, 0, int(step))


def save(
    directory: str | Path,
    *,
    model: torch.nn.Module | None,
    state: TrainingState,
    config: dict[str, Any],
    metrics: dict[str, Any],
    shards: dict[str, dict[str, Any]] | None = None,
) -> tuple[str, ...]:
    """Write a complete checkpoint into an empty `directory` (rank 0 only): with `model`, its weights;
    sharded (`model` None), the manifest lists `shards` (every rank's `digests` of SHARDS_DIR, written
    on storage already) instead. Returns the files written, in their order, the manifest last."""
    directory = Path(directory)
    parts = PARTS if model is not None else SHARDED_PARTS
    if model is not None:
        torch.save(model_weights(model), directory / MODEL_FILE)
    torch.save(asdict(state), directory / STATE_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
    manifest = digests(directory, parts) | {f"{SHARDS_DIR}/{name}": digest for name, digest in (shards or {}).items()}
    (directory / MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": manifest}, indent=2))
    return (*parts, MANIFEST_FILE)


def digests(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of each file `names` of `directory`, as the manifest lists them."""
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)} for name in names}


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of `model`: its state_dict less the frozen parameters (none, for most)."""
    frozen = _frozen(model)
    return {name: tensor for name, tensor in model.state_dict().items() if name not in frozen}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's weights into a freshly built `model`: every entry must fit, and only frozen
    parameters may be missing."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trained_missing = sorted(set(missing) - _frozen(model))
    if unexpected or trained_missing:
        raise CheckpointError(
            f"the checkpoint's weights do not fit the model: missing {trained_missing[:5]}, "
            f"unexpected {unexpected[:5]}; was it written by another model config?"
        )


def _frozen(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def verify(directory: str | Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is present, whole and unchanged."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"no {MANIFEST_FILE}: the checkpoint was never completed")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable {MANIFEST_FILE}: {e}") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{name} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{name} is truncated or overwritten ({size} bytes, the manifest says {expected['bytes']})"
            )
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{name} does not match its checksum (the bytes changed after it was written)")


@dataclass(frozen=True)
class Verified:
    """A checkpoint directory whose manifest has been checked: its parts can be read."""

    directory: Path

    @property
    def sharded(self) -> bool:
        """Written under FSDP2: the model and optimizer state are in SHARDS_DIR."""
        return (self.directory / SHARDS_DIR).is_dir()

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's saved weights, whole (a sharded checkpoint's assembled from every rank's shards)."""
        if self.sharded:
            return _assembled(self.directory / SHARDS_DIR, "model.")
        return torch.load(self.directory / MODEL_FILE, map_location="cpu", weights_only=True)

    def training_state(self) -> TrainingState:
        return TrainingState(**torch.load(self.directory / STATE_FILE, map_location="cpu", weights_only=True))

    def config(self) -> dict[str, Any]:
        return json.loads((self.directory / CONFIG_FILE).read_text())

    def metrics(self) -> dict[str, Any]:
        return json.loads((self.directory / METRICS_FILE).read_text())


def _assembled(shards: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` of a torch.distributed.checkpoint directory, whole, read in this one
    process (DCP's no_dist load: each tensor's shards, from every rank that wrote one, put together)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(shards).read_metadata().state_dict_metadata
    whole = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(whole, storage_reader=dcp.FileSystemReader(shards), no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in whole.items()}


def open_verified(directory: str | Path) -> Verified:
    """Check the manifest once, then read any part: the only way this module reads a checkpoint."""
    verify(directory)
    return Verified(Path(directory))


@dataclass(frozen=True)
class Skipped:
    """A checkpoint that failed verification."""

    path: str
    reason: str

    @property
    def name(self) -> str:
        return Path(self.path).name

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


@dataclass(frozen=True)
class Opened:
    """The first of a run's checkpoints that verified, and those skipped on the way to it."""

    checkpoint: ray.train.Checkpoint | None  # None: train from the start (`open_resume_point`'s start_over)
    verified: Verified | None
    skipped: list[Skipped]
    recorded: bool = True  # in Ray's record of the run; False: written and reported, not recorded (`unrecorded`)

    @property
    def name(self) -> str:
        return Path(self.checkpoint.path).name

    @property
    def location(self) -> str:
        return location(self.checkpoint)


def location(checkpoint: ray.train.Checkpoint) -> str:
    """Where a checkpoint is, as users name it: a path, or a URI (`checkpoint.path` drops the scheme)."""
    scheme = checkpoint.filesystem.type_name
    return checkpoint.path if scheme == "local" else f"{scheme}://{checkpoint.path}"


def newest_unrecorded(run_path: str, latest: str | None) -> str | None:
    """The name of the run's newest checkpoint newer than `latest` that verifies (what a restart
    resumes from, if any: see `open_resume_point`)."""
    with open_resume_point(None, [], unrecorded(run_path, latest)) as opened:
        return None if opened is None else opened.name


def newest_first(reported: Iterable[tuple[ray.train.Checkpoint, dict[str, Any]]]) -> list[ray.train.Checkpoint]:
    """A run's committed checkpoints (with the metrics reported with each), newest first: by the
    optimizer step they were written at, which only grows within a run."""
    return [checkpoint for checkpoint, metrics in sorted(reported, key=lambda cm: cm[1].get("step", -1), reverse=True)]


def rank(metrics: dict[str, Any], score_attribute: str, score_order: str) -> tuple[bool, float, int]:
    """How good the checkpoint reported with `metrics` is; a larger rank is better. Ray Train 2.60's
    checkpoint manager, deciding what `checkpoint.num_to_keep` keeps, ranks by the score (NaN or a
    missing score last), and among equal scores ranks the later report better: it deletes the
    earliest of equals first. So here: the score, then the step (which only grows within a run). The
    console's ★ best, the checkpoint registered and the summary's best checkpoint all follow it, so
    the one they name is the one Ray keeps."""
    value = float(metrics.get(score_attribute, math.nan))
    step = int(metrics.get("step", -1))
    if math.isnan(value):
        return False, -math.inf, step
    return True, value if score_order == "max" else -value, step


def best_first(
    reported: Iterable[tuple[ray.train.Checkpoint, dict[str, Any]]], score_attribute: str, score_order: str
) -> list[tuple[ray.train.Checkpoint, dict[str, Any]]]:
    """A run's committed (checkpoint, metrics), best first by `rank`. Equal in score and step (a step
    trained again after its checkpoint was found damaged): the one Ray lists later, as Ray ranks it."""
    indexed = list(enumerate(reported))
    indexed.sort(key=lambda item: (*rank(item[1][1], score_attribute, score_order), item[0]), reverse=True)
    return [checkpoint_metrics for _, checkpoint_metrics in indexed]


def run_record(run_path: str) -> ray.train.Result | None:
    """Ray's record of a run's committed checkpoints, read from its directory on storage; None for a
    run with no checkpoint committed yet (or no directory). Reads storage only: no Ray needed."""
    # Ray Train announces, at INFO, that it found the run's record: expected here, and said by the plan.
    announcer = logging.getLogger("ray.train.v2._internal.execution.checkpoint.checkpoint_manager")
    level = announcer.level
    announcer.setLevel(max(level, logging.WARNING))
    try:
        record = ray.train.Result.from_path(run_path)
    except RuntimeError:
        return None
    finally:
        announcer.setLevel(level)
    return record if record.best_checkpoints else None


def unrecorded(run_path: str, latest: str | None) -> list[ray.train.Checkpoint]:
    """The run's checkpoints newer than the one named `latest`, Ray's latest (all, without one),
    newest first: written and reported by rank 0, not recorded by Ray Train (see the module's
    docstring). Unverified."""
    fs, directory = storage.locate(run_path)
    try:
        found = fs.get_file_info(FileSelector(directory, allow_not_found=True))
    except OSError:
        return []
    after = position(latest) if latest is not None else None
    newer = [
        (position(info.base_name), info.path)
        for info in found
        if info.type == FileType.Directory and position(info.base_name) is not None
    ]
    newer = [(where, path) for where, path in newer if after is None or where > after]
    return [ray.train.Checkpoint(path, filesystem=fs) for _, path in sorted(newer, reverse=True)]


def reported(
    run_path: str, record: ray.train.Result | None, listed: list[ray.train.Checkpoint] | None = None
) -> list[tuple[ray.train.Checkpoint, dict[str, Any]]]:
    """A run's checkpoints with the metrics reported with each, for ranking (`best_first`): Ray's
    record's, and those newer than its latest that verify but were never recorded (the run stopped as
    they landed, and nothing trained since to report them again), with the metrics they hold. A run
    that ended so has its last checkpoints there alone. `listed`: those `unrecorded` already gave."""
    committed = list(record.best_checkpoints) if record is not None else []
    if listed is None:
        listed = unrecorded(run_path, None if record is None else Path(record.checkpoint.path).name)
    whole = []
    for checkpoint in listed:
        with checkpoint.as_directory() as directory:
            try:
                whole.append((checkpoint, open_verified(directory).metrics()))
            except CheckpointError:
                continue  # never whole: not a checkpoint
    return committed + whole


@contextlib.contextmanager
def open_resume_point(
    latest: ray.train.Checkpoint | None,
    committed: Iterable[tuple[ray.train.Checkpoint, dict[str, Any]]],
    unrecorded: Iterable[ray.train.Checkpoint] = (),
    world_size: int | None = None,
    start_over: bool = False,
) -> Iterator[Opened | None]:
    """Open the checkpoint a run resumes from: the newest of its `unrecorded` ones that verifies (one
    that does not was never whole: passed over in silence), else Ray's latest committed one or, where
    that is damaged, the newest of the run's other committed checkpoints (with their metrics) that
    verifies; None for a run with no checkpoint recorded nor whole. On `world_size` workers, a
    mid-epoch checkpoint of another number of workers is passed over too (`resumable_on`), and
    `start_over` (an elastic run, resized by Ray) trains from the start, an Opened with no checkpoint,
    where all it passed over is mid-epoch in the first epoch: the epoch's end before them is the run's
    start. The driver (from the run's record) and the workers (from Ray Train's context) both decide it
    here."""
    skipped = []
    for checkpoint in unrecorded:
        with checkpoint.as_directory() as directory:
            try:
                verified = open_verified(directory)
            except CheckpointError:
                continue
            if (why := resumable_on(checkpoint, verified, world_size)) is not None:
                skipped.append(Skipped(location(checkpoint), why))
                continue
            yield Opened(checkpoint, verified, skipped, recorded=False)
            return
    if latest is None and not skipped:
        yield None
        return
    if latest is not None:
        older = [checkpoint for checkpoint in newest_first(committed) if checkpoint.path != latest.path]
        with contextlib.ExitStack() as stack:
            try:
                opened = stack.enter_context(open_first_verified([latest, *older], world_size))
            except NoValidCheckpoint as e:
                skipped += e.skipped
            else:
                yield Opened(opened.checkpoint, opened.verified, skipped + opened.skipped)
                return
    # Whole checkpoints, but none for this number of workers: not a new run either, unless an elastic
    # run is still in its first epoch.
    if not (start_over and all(_in_first_epoch(s) for s in skipped)):
        raise NoValidCheckpoint(_none_resumable(skipped, world_size), skipped)
    yield Opened(None, None, skipped)


def _in_first_epoch(skipped: Skipped) -> bool:
    """A checkpoint passed over as mid-epoch in the run's first epoch (for another number of workers)."""
    where = position(skipped.name)
    return skipped.reason.startswith(MID_EPOCH) and where is not None and where[:2] == (1, 0)


def resumable_on(checkpoint: ray.train.Checkpoint, verified: Verified, world_size: int | None) -> str | None:
    """Why a run on `world_size` workers cannot resume from `checkpoint`, if it cannot: one taken
    mid-epoch is a position in the data of the workers that wrote it (an epoch's end is one for any
    number of workers, see preflight's rule for resizing a run)."""
    where = position(Path(checkpoint.path).name)
    if world_size is None or where is None or where[1] == 1:
        return None
    metrics = verified.metrics()
    wrote = metrics["workers"] if "workers" in metrics else verified.config()["scaling"]["num_workers"]  # older
    if wrote == world_size:
        return None
    return f"{MID_EPOCH}, a position in the data of {wrote} workers, not {world_size}"


@contextlib.contextmanager
def open_first_verified(checkpoints: Iterable[ray.train.Checkpoint], world_size: int | None = None) -> Iterator[Opened]:
    """Open the first of `checkpoints` that verifies (downloaded, if the storage is remote, for as long
    as the context lasts) and, given `world_size`, is `resumable_on` it. Raises NoValidCheckpoint,
    listing what is wrong with each, if none is."""
    skipped = []
    for checkpoint in checkpoints:
        with checkpoint.as_directory() as directory:
            try:
                verified = open_verified(directory)
            except CheckpointError as e:
                skipped.append(Skipped(location(checkpoint), str(e)))
                continue
            if (why := resumable_on(checkpoint, verified, world_size)) is not None:
                skipped.append(Skipped(location(checkpoint), why))
                continue
            yield Opened(checkpoint, verified, skipped)
            return
    raise NoValidCheckpoint(_none_resumable(skipped, world_size), skipped)


def _none_resumable(skipped: list[Skipped], world_size: int | None) -> str:
    resized = any(s.reason.startswith(MID_EPOCH) for s in skipped)
    said = "not one checkpoint verifies" + (
        f" and is resumable on {world_size} workers (resume on the number that wrote the newest, to its "
        "epoch's end, then change it; an elastic run needs an epoch's end kept: raise checkpoint.num_to_keep)"
        if resized
        else ""
    )
    return f"{said}: " + "; ".join(str(s) for s in skipped)


def rng_state() -> dict[str, Any]:
    """This process's random state, in types that `weights_only` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    # random.setstate wants the nested tuples that torch.save may hand back as lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
