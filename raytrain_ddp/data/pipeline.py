"""A rank's reading pipeline for a streamed dataset: its pieces of the epoch (epoch.py) read in Ray Data
tasks (or here, for a dataset's blocks), windows shuffled, cut into batches; a resumed epoch starts at
its first untrained batch."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from raytrain_ddp.data import epoch as planning
from raytrain_ddp.data.stream import BadFile, Row, Stream, concatenate, length

logger = logging.getLogger(__name__)
POSITION = "_position"  # a read row's place in its rank's share, dropped before training


# Reading: on the workers (the pipeline) and in Ray Data's tasks (`read_pieces`).


def read_pieces(batch: dict[str, np.ndarray], stream: Stream, seed: int, epoch: int, skip_bad: bool) -> Row:
    """A Ray Data task: read a batch of pieces, transform their rows, and number them by position. An
    unreadable file raises BadFile, or, with `skip_bad`, is left out (its positions stay empty: the
    rank notices, and counts it)."""
    read: list[Row] = []
    for path, label, start, stop, position, first_row in zip(
        batch["path"], batch["label"], batch["start"], batch["stop"], batch["position"], batch["first_row"]
    ):
        try:
            rows = stream.read(str(path), int(start), int(stop), int(label))
        except BadFile as e:
            if not skip_bad:
                raise BadFile(f"{e}; remove it or set data.max_bad_files") from None
            logger.warning("skipped: %s", e)
            continue
        rows = stream.transformed(rows, seed, epoch, int(first_row))
        rows[POSITION] = np.arange(int(position), int(position) + int(stop) - int(start), dtype=np.int64)
        read.append(rows)
    return concatenate(read) if read else {POSITION: np.zeros(0, dtype=np.int64)}


@dataclass
class Pipeline:
    """One rank's batches of a stream, read by its own Ray Data pipeline: training (`equal` shares,
    shuffled as `shuffle` says) or validation (contiguous ranges, in file order)."""

    stream: Stream
    rank: int
    world_size: int
    seed: int
    batch_size: int
    data: Any  # config.DataSettings
    shuffle: bool = False
    shuffle_rows: int = 1
    drop_last: bool = False
    group_by: str | None = None  # the column of each row's length: batches of similar length (train.group_by_length)
    equal: bool = True
    bad_files: set[str] = field(default_factory=set)  # of the epoch being read, on this rank
    rows_read: int = 0  # rows read of the epoch being read, on this rank (from its start or resume point)

    def batches(self, epoch: int, first_batch: int = 0) -> Iterator[Row]:
        """This rank's batches of `epoch` from batch `first_batch` on, as numpy columns. Reads nothing
        before the window of `first_batch`."""
        plan = self.plan(epoch, first_batch)
        try:
            yield from self.batched(plan, self._read(plan.pieces, epoch))
        except BadFile:
            raise
        except Exception as e:  # a task's BadFile reaches us as Ray Data's error, its message in the text
            found = re.search(rf"{BadFile.__module__}\.BadFile: (.+)", str(e))
            if found is None:
                raise
            raise BadFile(found.group(1)) from e

    def plan(self, epoch: int, first_batch: int = 0) -> planning.EpochPlan:
        m = self.stream.manifest
        order = planning.file_order(len(m.files), self.seed, epoch, self.shuffle)
        first, end = planning.share(m.total, self.world_size, self.rank, self.equal)
        shuffled = self.shuffle and not self.stream.one_row_per_file
        window = planning.window_rows(self.batch_size, self.shuffle_rows, shuffled or self.group_by is not None)
        skip = first_batch * self.batch_size // window * window  # rows of the share that are not read at all
        most = self.data.task_rows if self.stream.read_in_tasks else max(1, m.total)  # a whole block, read here
        planned = planning.pieces(m, order, first + skip, end, first, most)
        return planning.EpochPlan(epoch, first_batch, planned, skip, end - first, window, shuffled)

    def batched(self, plan: planning.EpochPlan, blocks: Iterator[Row]) -> Iterator[Row]:
        """Batches of the rows read for `plan` (blocks in position order, as `read_pieces` makes them)."""
        size, self.bad_files, self.rows_read = self.batch_size, set(), 0
        windows = _windows(blocks, plan.skip, plan.rows, plan.window)
        for w, (origin, rows, positions) in enumerate(windows, start=plan.skip // plan.window):
            self.rows_read += len(positions)
            slots = planning.window_order(
                min(plan.window, plan.rows - origin), self.seed, plan.epoch, self.rank, w, plan.shuffled
            )
            index = np.full(len(slots), -1, dtype=np.int64)
            index[positions - origin] = np.arange(len(positions))
            if self.group_by is not None:
                slots = planning.by_length(slots, self._lengths(rows, index[slots]), size, self.seed, plan.epoch, w)
            for b in range(0, len(slots), size):
                batch = (origin + b) // size
                if batch < plan.first_batch:
                    continue
                if self.drop_last and b + size > len(slots):
                    return
                taken = index[slots[b : b + size]]
                if (taken < 0).any():  # rows of skipped files
                    self._missing(plan.pieces, origin + slots[b : b + size][taken < 0])
                    taken = taken[taken >= 0]
                    if len(taken) == 0:
                        where = f"batch {batch} of epoch {plan.epoch + 1} on rank {self.rank}"
                        raise BadFile(f"every row of {where} was unreadable")
                yield {name: column[taken] for name, column in rows.items()}

    def _lengths(self, rows: Row, taken: np.ndarray) -> np.ndarray:
        """The group_by column of the rows at `taken` (-1: a row of a skipped file, counted as length 0)."""
        lengths, read = np.zeros(len(taken), dtype=np.int64), taken >= 0
        if read.any():
            lengths[read] = rows[self.group_by][taken[read]]
        return lengths

    def _read(self, planned: list[planning.Piece], epoch: int) -> Iterator[Row]:
        import ray
        import ray.data

        from raytrain_ddp.ray_compat.prestart import tasks_runtime_env

        if not planned:
            return iter(())
        if not self.stream.read_in_tasks:
            return self._read_here(planned, epoch)
        d = self.data
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        options = context.execution_options
        options.preserve_order = True  # positions arrive in order: a window is whole once a later one starts
        store = d.object_store_mb * 2**20 if d.object_store_mb else None
        if store is None:  # Ray Data's default share of the object store, split between the ranks' pipelines
            store = 0.5 * ray.cluster_resources().get("object_store_memory", 0) / self.world_size or None
        options.resource_limits = options.resource_limits.copy(cpu=d.cpus, object_store_memory=store)
        options.label_selector = dict(d.label_selector) or None
        per_task = max(1, d.task_rows // max(p.stop - p.start for p in planned))  # pieces a task reads
        items = [vars(p) for p in planned]
        dataset = ray.data.from_items(items, override_num_blocks=math.ceil(len(items) / per_task))
        read = dataset.map_batches(
            read_pieces,
            batch_size=per_task,
            batch_format="numpy",
            # The stream without its file list: each task reads only its pieces.
            fn_kwargs={"stream": replace(self.stream, manifest=None), "seed": self.seed, "epoch": epoch}
            | {"skip_bad": d.max_bad_files > 0},
            runtime_env=tasks_runtime_env(),  # not this worker's setup hook: a reading task needs no torch
        )
        return read.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)

    def _read_here(self, planned: list[planning.Piece], epoch: int) -> Iterator[Row]:
        """The pieces read by this rank, as a reading task would (`read_pieces`), on a thread a piece
        ahead of training: on a GPU the next block's fetch and copy overlap the step."""

        def read(piece: planning.Piece) -> Row:
            return read_pieces({k: [v] for k, v in vars(piece).items()}, self.stream, self.seed, epoch, skip_bad=False)

        with ThreadPoolExecutor(1, thread_name_prefix="blocks") as pool:
            ahead = pool.submit(read, planned[0])
            for piece in planned[1:]:
                current, ahead = ahead, pool.submit(read, piece)
                yield current.result()
            yield ahead.result()

    def _missing(self, planned: list[planning.Piece], positions: np.ndarray) -> None:
        """Name the files of rows that their task left out (unreadable, skipped)."""
        for position in positions:
            for piece in planned:
                if piece.position <= position < piece.position + piece.stop - piece.start:
                    self.bad_files.add(piece.path)
                    break


def _windows(blocks: Iterator[Row], skip: int, rows: int, window: int) -> Iterator[tuple[int, Row, np.ndarray]]:
    """Group blocks of rows (in position order) into windows: (window's first position, its rows, their
    positions). Each block is copied out of the object store as it arrives: Ray Data's numpy batches are
    views of it, and a window held on views would pin its blocks there (up to a window of them)."""
    origin, held = skip, []
    for block in blocks:
        block = {name: np.array(column) for name, column in block.items()}
        positions = block[POSITION]
        if len(positions) == 0:
            continue
        while positions[0] >= origin + window:  # the window before this block is whole
            yield _window(origin, held)
            origin, held = origin + window, []
        cut = int(np.searchsorted(positions, origin + window))
        held.append({k: v[:cut] for k, v in block.items()})
        rest = {k: v[cut:] for k, v in block.items()}
        while length(rest):
            yield _window(origin, held)
            origin += window
            cut = int(np.searchsorted(rest[POSITION], origin + window))
            held, rest = [{k: v[:cut] for k, v in rest.items()}], {k: v[cut:] for k, v in rest.items()}
    while origin < rows:
        yield _window(origin, held)
        origin, held = origin + window, []


def _window(origin: int, held: list[Row]) -> tuple[int, Row, np.ndarray]:
    rows = concatenate([h for h in held if length(h)]) if any(length(h) for h in held) else {}
    positions = rows.pop(POSITION, np.zeros(0, dtype=np.int64))
    return origin, rows, positions
