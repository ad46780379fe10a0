"""A tiny recipe for the DDP-practice and reliability tests: an MLP on a generated regression table
whose size the test chooses, served through Ray Data (materialized, or lazy), as a torch Dataset or
streamed from Parquet shards (`source: parquet`: written under `dataset.path` first, 5 shards a split
of uneven sizes, with an `id` column), with faults injected on request. Lazy (`source: lazy-ray`), with
a `dataset.path`, each Ray Data task of a split notes its time and process in `<path>/<split>.pids`.

The table does not depend on `seed` (so runs with different seeds see the same rows); `seed` still
drives the model's initialization, the shuffle and dropout, through the service.

Faults (`model.faults`, with `model.fault_log` a directory the test owns) are "RANK:N:ACTION": when
rank RANK (or `*`, every rank) makes its N-th training forward pass, counted over all attempts of
the run (each pass appends "<world size>:<pid>" to fault_log/rank<R>.log, so the log also tells the
attempts apart; and a line of that tag and its rows' first features, which tell rows apart, to
fault_log/rows<R>.log, in one write: a worker killed between the two files leaves no line of rows
without its pass).
`exit` (os._exit) and `kill` (SIGKILL) fire at pass N only; `raise` (a
RuntimeError), `nan` (a NaN output) and `noscore` (evaluate drops the `mse` metric) hold from pass
N on, in every later attempt too.

`model.width` is the hidden layer's width (16; a larger one makes a larger checkpoint).

`model.step_s` makes each training pass of a worker wait that long: a run a test watches for a while
(until it stops it, or while other runs meet it) keeps going without taking the cores the other
tests work on.

It counts its own FLOPs (`count_flops`): the one way a CPU run reports model FLOP/s.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Literal

import numpy as np
import ray.data
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from raytrain_ddp import stream


class MLP(nn.Module):
    def __init__(
        self,
        width: int,
        dropout: float,
        unused_branch: bool,
        faults: list[tuple[str, int, str]],
        fault_log: str | None,
        step_s: float | None = None,
    ):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Dropout(dropout), nn.Linear(width, 1))
        # Parameters that never get a gradient: DDP needs find_unused_parameters=true for them.
        self.unused = nn.Linear(4, 1) if unused_branch else None
        self.faults, self.fault_log, self.step_s = faults, fault_log, step_s
        self.drops_score = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x).squeeze(1)
        # Passes of the training workers only (in a process group): not the driver's pre-flight pass.
        in_training = self.training and torch.distributed.is_initialized()
        if in_training and self.step_s:
            time.sleep(self.step_s)
        return self._inject(x, out) if in_training and self.fault_log else out

    def _inject(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        import ray.train

        context = ray.train.get_context()
        rank = context.get_world_rank()
        log = Path(self.fault_log) / f"rank{rank}.log"
        tag = f"{context.get_world_size()}:{os.getpid()}"
        with log.open("a") as f:
            f.write(tag + "\n")
        with (Path(self.fault_log) / f"rows{rank}.log").open("a") as f:  # each row by its first feature
            f.write(" ".join([tag, *(f"{v:.6f}" for v in x[:, 0].tolist())]) + "\n")
        passes = len(log.read_text().split())
        for who, n, action in self.faults:
            if who not in ("*", str(rank)):
                continue
            if action == "exit" and passes == n:
                os._exit(1)
            if action == "kill" and passes == n:
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "raise" and passes >= n:
                raise RuntimeError(f"injected fault at training pass {passes} of rank {rank}")
            if action == "nan" and passes >= n:
                out = out * float("nan")
            if action == "noscore" and passes >= n:
                self.drops_score = True
        return out


def build_model(
    *,
    width: int = 16,
    dropout: float = 0.0,
    unused_branch: bool = False,
    faults: list[str] = [],  # noqa: B006 - read, never mutated
    fault_log: str | None = None,
    step_s: float | None = None,  # None, not 0: a run saved before the key existed resumes (its config has none)
) -> nn.Module:
    parsed = []
    for fault in faults:
        who, n, action = fault.split(":")
        if action not in ("exit", "kill", "raise", "nan", "noscore") or not (who == "*" or who.isdigit()):
            raise ValueError(f"fault {fault!r}: expected RANK:N:ACTION (see tests/jobs/tiny.py)")
        parsed.append((who, int(n), action))
    if parsed and fault_log is None:
        raise ValueError("faults need a fault_log directory")
    return MLP(width, dropout, unused_branch, parsed, fault_log, step_s)


class Rows(Dataset):
    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def build_datasets(
    *,
    seed: int,
    rows: int = 64,
    val_rows: int = 15,
    source: Literal["ray", "lazy-ray", "torch", "parquet"] = "ray",
    path: str | None = None,
):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(rows + val_rows, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32) + 0.1 * rng.normal(size=len(x))).astype(np.float32)
    splits = {"train": (x[:rows], y[:rows]), "val": (x[rows:], y[rows:])}
    if source == "parquet":
        if path is None:
            raise ValueError("source: parquet needs dataset.path, a directory to write the shards to")
        return {name: _shards(Path(path) / name, *arrays) for name, arrays in splits.items()}
    if source == "torch":
        return {name: Rows(*arrays) for name, arrays in splits.items()}
    datasets = {
        name: ray.data.from_items([{"x": a, "y": b} for a, b in zip(*arrays)]) for name, arrays in splits.items()
    }
    if source == "lazy-ray":  # not run until training reads it: Ray Data then needs a CPU of its own
        return {
            name: ds.map_batches(_noted, fn_kwargs={"log": path and f"{path}/{name}.pids"})
            for name, ds in datasets.items()
        }
    return {name: ds.materialize() for name, ds in datasets.items()}


def _noted(batch: dict[str, np.ndarray], log: str | None) -> dict[str, np.ndarray]:
    """A lazy dataset's step: the batch as it is; with `log`, a line of the time and the process."""
    if log:
        with open(log, "a") as f:
            f.write(f"{time.time()} {os.getpid()}\n")
    return batch


def _shards(root: Path, x: np.ndarray, y: np.ndarray) -> stream.Parquet:
    """The rows as 5 Parquet shards of uneven sizes (written once), streamed: columns x, y and id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not root.exists():
        root.mkdir(parents=True)
        cuts = np.cumsum([0, 3, 1, 4, 1, 5]) * len(y) // 14  # shards of 3/14, 1/14, ... of the rows
        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            table = pa.table({"x": list(x[a:b]), "y": y[a:b], "id": np.arange(a, b)})
            pq.write_table(table, root / f"part-{k}.parquet")
    return stream.Parquet(str(root), columns=("x", "y", "id"))


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    error = F.mse_loss(model(batch["x"]), batch["y"], reduction="sum"), len(batch["y"])
    return {"sse": error} if getattr(model, "drops_score", False) else {"mse": error}


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"]


def count_flops(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """A training step's FLOPs, in closed form (so a CPU run reports model FLOP/s, see raytrain_ddp/worker/flops.py):
    per row, 2 per weight of the two layers forward, 2 per weight for their gradients, and 2 per weight
    of the second for its input's gradient (the data needs none)."""
    return flops_per_row(model.body[0].out_features) * len(batch["x"])


def flops_per_row(width: int) -> int:
    return 2 * (4 * width + width) * 2 + 2 * width


FLOPS_PER_ROW = flops_per_row(16)  # of the default width
