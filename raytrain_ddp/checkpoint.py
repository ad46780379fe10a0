"""The checkpoint format: what a checkpoint holds, how rank 0 writes it, how it is read back.

A checkpoint is a directory:

    model.pt        state_dict of the unwrapped model (never the DDP wrapper's)
    train_state.pt  optimizer, LR-schedule and grad-scaler state, epochs and steps done, every rank's RNG state
    config.json     the resolved run config
    metrics.json    the metrics reported with it
    manifest.json   size and sha256 of each file above; written last, so no manifest = not a checkpoint

Tensors load with `torch.load(weights_only=True)`: reading a checkpoint never unpickles arbitrary
objects. Reading starts with `open_verified`, which checks the manifest once.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"
MANIFEST_FILE = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or corrupt."""


@dataclass(frozen=True)
class TrainingState:
    epoch: int  # epochs completed
    step: int  # optimizer steps completed
    updater: dict[str, Any]  # optimizer, scheduler and scaler state, from `optim.Updater.state_dict()`
    rng: list[dict[str, Any]]  # one per world rank, from `rng_state()`


def save(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    state: TrainingState,
    config: dict[str, Any],
    metrics: dict[str, Any],
) -> None:
    """Write a complete checkpoint into an empty `directory` (rank 0 only)."""
    directory = Path(directory)
    torch.save(model.state_dict(), directory / MODEL_FILE)
    torch.save(asdict(state), directory / STATE_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
    files = (MODEL_FILE, STATE_FILE, CONFIG_FILE, METRICS_FILE)
    manifest = {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)} for name in files}
    (directory / MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": manifest}, indent=2))


def verify(directory: str | Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is present, whole and unchanged."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST_FILE}; the checkpoint was never completed")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{directory}: unreadable {MANIFEST_FILE}: {e}") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory}: {name} is missing")
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{directory}: {name} does not match its checksum (truncated or modified)")


@dataclass(frozen=True)
class Verified:
    """A checkpoint directory whose manifest has been checked: its parts can be read."""

    directory: Path

    def model_state(self) -> dict[str, torch.Tensor]:
        return torch.load(self.directory / MODEL_FILE, map_location="cpu", weights_only=True)

    def training_state(self) -> TrainingState:
        return TrainingState(**torch.load(self.directory / STATE_FILE, map_location="cpu", weights_only=True))

    def config(self) -> dict[str, Any]:
        return json.loads((self.directory / CONFIG_FILE).read_text())

    def metrics(self) -> dict[str, Any]:
        return json.loads((self.directory / METRICS_FILE).read_text())


def open_verified(directory: str | Path) -> Verified:
    """Check the manifest once, then read any part: the only way this module reads a checkpoint."""
    verify(directory)
    return Verified(Path(directory))


def rng_state() -> dict[str, Any]:
    """This process's random state, in types that `weights_only` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached_gaussian": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
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
