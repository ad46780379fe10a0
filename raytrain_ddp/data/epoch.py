"""The pure plan of one epoch of a streamed dataset: which files, rows and windows rank r trains in epoch
e, a function of (seed, epoch, world size, the file list) and nothing else (stream.py says the rules)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from raytrain_ddp.data.seeds import FILE_ORDER, LENGTH_GROUPS, SHUFFLE, derive_seed
from raytrain_ddp.data.stream import Manifest

# The epoch's plan: which rows each rank trains, in which order. Pure functions of their arguments.


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one file, the first of them at `position` in a rank's share."""

    path: str
    label: int
    start: int
    stop: int
    position: int
    first_row: int  # the row id of the file's row `start`


def file_order(files: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order the files are read in an epoch."""
    if not shuffle:
        return np.arange(files)
    return np.random.default_rng(derive_seed(seed, FILE_ORDER, epoch)).permutation(files)


def share(total: int, world_size: int, rank: int, equal: bool) -> tuple[int, int]:
    """Rank `rank`'s rows [first, end) of an epoch's sequence: equal shares (training: the last
    total % world_size rows are left out), or contiguous ranges that cover every row (validation)."""
    if equal:
        n = total // world_size
        return rank * n, (rank + 1) * n
    return total * rank // world_size, total * (rank + 1) // world_size


def pieces(manifest: Manifest, order: np.ndarray, first: int, end: int, origin: int, most: int) -> list[Piece]:
    """The pieces of files, of at most `most` rows, that hold rows [first, end) of the sequence `order`
    makes, their positions counted from `origin` (the share's first row)."""
    rows, first_row = manifest.rows[order], manifest.first_row
    ends = np.cumsum(rows)
    starts = ends - rows
    found = []
    for k in range(int(np.searchsorted(ends, first, side="right")), len(order)):
        if starts[k] >= end:
            break
        i = int(order[k])
        lo, hi = max(first, int(starts[k])) - int(starts[k]), min(end, int(ends[k])) - int(starts[k])
        label = int(manifest.labels[i]) if manifest.labels is not None else -1
        for a in range(lo, hi, most):  # a long file in pieces of at most `most` rows
            b = min(hi, a + most)
            found.append(Piece(manifest.files[i], label, a, b, int(starts[k]) + a - origin, int(first_row[i]) + a))
    return found


def window_rows(batch_size: int, shuffle_rows: int, shuffle: bool) -> int:
    """Rows shuffled together in a share: whole batches; one batch where nothing is shuffled."""
    if not shuffle:
        return batch_size
    return batch_size * max(1, math.ceil(shuffle_rows / batch_size))


def window_order(rows: int, seed: int, epoch: int, rank: int, window: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(rows)
    return np.random.default_rng(derive_seed(seed, SHUFFLE, epoch, rank, window)).permutation(rows)


def by_length(slots: np.ndarray, lengths: np.ndarray, batch_size: int, seed: int, epoch: int, window: int):
    """A window's slots regrouped into batches of rows of similar length: longest first (ties in the
    window's own order), cut into batches, the whole batches in an order seeded by (seed, epoch, window)
    and the partial one, of the shortest rows, last (where drop_last drops it). The order is the same on
    every rank, so at each step every rank trains its batch of the same length rank: a rank with short
    rows does not wait in the gradient all-reduce for one with long rows."""
    ordered = slots[np.argsort(-lengths, kind="stable")]
    whole = len(ordered) // batch_size
    order = np.random.default_rng(derive_seed(seed, LENGTH_GROUPS, epoch, window)).permutation(whole)
    batches = ordered[: whole * batch_size].reshape(whole, batch_size)[order].ravel()
    return np.concatenate([batches, ordered[whole * batch_size :]])


@dataclass(frozen=True)
class EpochPlan:
    """What a rank reads of an epoch: `pieces`, from row `skip` of its share of `rows` rows, shuffled
    (or not) in windows of `window` rows; its batches from `first_batch` on."""

    epoch: int
    first_batch: int
    pieces: list[Piece]
    skip: int
    rows: int
    window: int
    shuffled: bool
