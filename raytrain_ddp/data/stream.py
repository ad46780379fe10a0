"""Streamed datasets: files read while training goes (a local path, NFS or s3://), never materialized.

A recipe's `build_datasets` returns them in place of Ray Datasets:

    from raytrain_ddp import stream

    def build_datasets(*, seed, path):
        return {"train": stream.ImageFolder(f"{path}/train", size=(32, 32), transform=augment),
                "val": stream.ImageFolder(f"{path}/val", size=(32, 32))}

    def augment(row: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        ...  # a random crop or flip drawn from rng

`ImageFolder` reads the images under `<root>/<class>/` (rows {"image": uint8 (H, W) or (H, W, C),
"label": int64, the class's index in sorted order}); `Parquet` reads the Parquet files under a path,
only `columns`. `transform(row, rng)` runs on every row as it is read, in Ray Data tasks on CPU (on
the nodes `data.label_selector` allows), with a generator seeded by (seed, epoch, row id): a row gets
the same augmentation in the same epoch of every run. A row's id is its place in the file list
(files sorted by path, rows in file order).

The driver lists the files once (`Manifest`: each file, its rows, its label; a Parquet file's rows
and columns from its footer). Each epoch, each rank computes its own share, a function of (seed,
epoch, world size, the file list) and nothing else:
- the files' order is a permutation seeded by (seed, epoch) (`train.shuffle`), rows in file order;
- rank r trains rows [r*n, (r+1)*n) of that sequence, n = rows // world size (up to world size - 1
  rows are left out an epoch, as with Ray Data's equal split), reading only the files they fall in;
- a Parquet share is shuffled within windows of `train.local_shuffle_buffer_size` rows (rounded up to
  whole batches), each by a permutation seeded by (seed, epoch, rank, window); an image folder, one row
  per file, is already shuffled by its file order;
- batch k is rows [k*B, (k+1)*B) of the shuffled share.
So a resumed epoch reads from the window of its first untrained batch (for images: that batch): the
rows trained before are not read again, and the batches that follow are those of an uninterrupted
run. Validation rows are split in contiguous ranges, in file order, each row counted once.

Each rank runs its own Ray Data pipeline (`ray.data.from_items(pieces).map_batches(read)`): its reading
tasks run wherever Ray finds a CPU (another node's, with `data.label_selector`), and Ray Data's
backpressure keeps what the pipeline holds under `data.object_store_mb`.

`Blocks` plans a materialized Ray Dataset the same way, its blocks in the object store taking the
files' place: each rank reads its pieces itself (`ray.get`), with no Ray Data pipeline (datasets.py says
when the driver ships a dataset so).

A file that cannot be read (a truncated Parquet file, a missing column, an image that does not
decode) stops the run, named, unless `data.max_bad_files` allows skipping it: Parquet footers are read
when the files are listed, before any worker starts; images are decoded as they are read, and a
skipped one leaves its batch a row short (every rank still trains the same number of batches). The
skipped files are counted in every report (`data_bad_files`, logged to MLflow).
"""

from __future__ import annotations

import functools
import io
import logging
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from raytrain_ddp.checkpoint import storage
from raytrain_ddp.ray_compat import data as ray_compat

logger = logging.getLogger(__name__)

Row = dict[str, np.ndarray]
Transform = Callable[[Row, np.random.Generator], Row]
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LISTING_THREADS = 16  # Parquet footers read at once when listing (each a request on S3)


class BadFile(ValueError):
    """A data file that cannot be read as its dataset says."""


@dataclass(frozen=True)
class Manifest:
    """The files of a streamed dataset, listed once by the driver: rows per file, and the label of
    each (image folders) as class indices into `classes`. `skipped` are the unreadable files left out
    (`path: reason`)."""

    root: str
    files: tuple[str, ...]
    rows: np.ndarray  # int64, per file
    labels: np.ndarray | None = None  # int64 class index per file
    classes: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return int(self.rows.sum())

    @functools.cached_property
    def first_row(self) -> np.ndarray:
        """Each file's first row id."""
        return np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)


@dataclass(frozen=True)
class Stream:
    """A dataset read from files as training goes; `ImageFolder` and `Parquet` say how. `manifest`
    is filled by the driver (`listed`)."""

    path: str
    transform: Transform | None = None
    manifest: Manifest | None = field(default=None, repr=False)

    one_row_per_file = False
    read_in_tasks = True  # by Ray Data tasks (files); False: by the rank itself (`Blocks`)

    def listed(self, max_bad_files: int) -> Stream:
        """This stream with its files listed; raises BadFile naming the files it cannot use, beyond
        `max_bad_files`."""
        manifest = self._list()
        if len(manifest.skipped) > max_bad_files:
            shown = "; ".join(manifest.skipped[:5]) + (" ..." if len(manifest.skipped) > 5 else "")
            raise BadFile(
                f"{len(manifest.skipped)} unreadable file(s) under {self.path}: {shown}; repair or remove them, "
                f"or set data.max_bad_files={len(manifest.skipped)} (or more) to train without them"
            )
        if manifest.total == 0:
            raise BadFile(f"{self.path}: no rows to read (no {self._what} found there)")
        return replace(self, manifest=manifest)

    def read(self, path: str, start: int, stop: int, label: int) -> Row:
        """Rows [start, stop) of one file, as numpy columns."""
        raise NotImplementedError

    def example(self, n: int, seed: int) -> Row:
        """The first `n` rows, transformed as in epoch 0: read here, without Ray Data."""
        m = self.manifest
        rows: list[Row] = []
        for i, path in enumerate(m.files):
            if (have := sum(length(r) for r in rows)) >= n:
                break
            want = min(n - have, int(m.rows[i]))
            if want == 0:  # an empty block
                continue
            label = int(m.labels[i]) if m.labels is not None else -1
            rows.append(self.transformed(self.read(path, 0, want, label), seed, 0, int(m.first_row[i])))
        return concatenate(rows)

    def transformed(self, rows: Row, seed: int, epoch: int, first_row: int) -> Row:
        """`rows` (consecutive, the first with id `first_row`) through `transform`, each with its own generator."""
        if self.transform is None:
            return rows
        out = [
            self.transform({name: column[i] for name, column in rows.items()}, row_rng(seed, epoch, first_row + i))
            for i in range(length(rows))
        ]
        return {name: np.stack([row[name] for row in out]) for name in out[0]} if out else rows

    def _list(self) -> Manifest:
        raise NotImplementedError

    _what = "files"


@dataclass(frozen=True)
class ImageFolder(Stream):
    """Images in class folders, `<path>/<class>/<file>` (any depth below the class). Each image is
    decoded with Pillow, converted to `mode` ("RGB", "L" for grayscale) and, with `size` (height,
    width), resized, so that images of different sizes stack into batches. The labels are the class
    folders' indices in `classes` (default: the folders found, sorted): a validation set names the
    training set's, so that a class it lacks does not move the others' labels."""

    size: tuple[int, int] | None = None
    mode: Literal["RGB", "L"] = "RGB"
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS
    classes: tuple[str, ...] | None = None

    one_row_per_file = True
    _what = f"images ({', '.join(IMAGE_EXTENSIONS)}) in class folders"

    def class_names(self) -> tuple[str, ...]:
        """The class folders that hold images, sorted: the labels 0, 1, ... (listed now)."""
        return self._list().classes

    def _list(self) -> Manifest:
        fs, root = _filesystem(self.path)
        files = [f for f in _files_under(fs, root, self.extensions) if "/" in _relative(root, f)]  # else no class
        found = sorted({_relative(root, f).split("/")[0] for f in files})
        classes = found if self.classes is None else list(self.classes)
        if unknown := [name for name in found if name not in classes]:
            raise BadFile(
                f"{self.path}: class folder(s) {', '.join(unknown)} not among the {len(classes)} classes "
                f"it is read with ({', '.join(classes)}): each class folder must be one of the training set's"
            )
        index = {name: i for i, name in enumerate(classes)}
        labels = np.array([index[_relative(root, f).split("/")[0]] for f in files], dtype=np.int64)
        uris = tuple(_uri(self.path, root, f) for f in files)
        return Manifest(self.path, uris, np.ones(len(files), dtype=np.int64), labels, tuple(classes))

    def read(self, path: str, start: int, stop: int, label: int) -> Row:
        from PIL import Image

        fs, fs_path = _filesystem(path)
        with fs.open_input_stream(fs_path) as f:
            data = f.read()
        try:
            with Image.open(io.BytesIO(data)) as image:
                image = image.convert(self.mode)
                if self.size is not None and image.size != (self.size[1], self.size[0]):
                    image = image.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR)
                pixels = np.asarray(image, dtype=np.uint8)
        except Exception as e:  # Pillow's errors for a file that is not a whole image vary by format
            raise BadFile(f"{path}: not a readable image ({_reason(e)})") from e
        return {"image": pixels[None], "label": np.array([label], dtype=np.int64)}


@dataclass(frozen=True)
class Parquet(Stream):
    """The Parquet files under `path` (`*.parquet`, any depth), reading only `columns` (all, if None).
    A list column (token ids, say) must hold lists of one length, to stack into a batch."""

    columns: tuple[str, ...] | None = None

    _what = "*.parquet files"

    def _list(self) -> Manifest:
        fs, root = _filesystem(self.path)
        files = _files_under(fs, root, (".parquet",))
        with ThreadPoolExecutor(LISTING_THREADS) as pool:
            found = list(pool.map(lambda f: self._rows(fs, f), files))
        kept = [(f, rows) for f, (rows, _) in zip(files, found) if rows is not None]
        skipped = tuple(f"{_uri(self.path, root, f)}: {problem}" for f, (_, problem) in zip(files, found) if problem)
        return Manifest(
            self.path,
            tuple(_uri(self.path, root, f) for f, _ in kept),
            np.array([rows for _, rows in kept], dtype=np.int64),
            skipped=skipped,
        )

    def first_rows(self, n: int) -> Row:
        """The first `n` rows, in file order and untransformed, read here: a sample for a recipe's
        statistics (build_datasets' `fitted`)."""
        fs, root = _filesystem(self.path)
        rows: list[Row] = []
        for path in _files_under(fs, root, (".parquet",)):
            if (got := sum(length(r) for r in rows)) >= n:
                break
            try:
                rows.append(self.read(_uri(self.path, root, path), 0, n - got, -1))
            except BadFile:  # listing the files names it, and data.max_bad_files decides
                continue
        return concatenate(rows)

    def column_range(self, name: str) -> tuple[Any, Any]:
        """The smallest and largest value of column `name` over every file (listed now): from the
        footers' statistics where every row group has them, else by reading that column alone."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        fs, root = _filesystem(self.path)
        ranges = []
        for path in _files_under(fs, root, (".parquet",)):
            try:
                with fs.open_input_file(path) as f:
                    parquet = pq.ParquetFile(f)
                    if (index := parquet.schema_arrow.get_field_index(name)) < 0:
                        continue
                    stats = [
                        parquet.metadata.row_group(g).column(index).statistics for g in range(parquet.num_row_groups)
                    ]
                    if all(g is not None and g.has_min_max for g in stats):
                        ranges += [(g.min, g.max) for g in stats]
                    elif (column := parquet.read(columns=[name]).column(0)).length():
                        found = pc.min_max(column)
                        ranges.append((found["min"].as_py(), found["max"].as_py()))
            except Exception:  # noqa: BLE001 - a file it cannot read: listing the files names it, and
                continue  # data.max_bad_files decides
        if not ranges:
            raise BadFile(f"{self.path}: no rows to read (no {self._what} found there)")
        return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)

    def _rows(self, fs, path: str) -> tuple[int | None, str | None]:
        """A file's rows from its footer, or why it cannot be used."""
        import pyarrow.parquet as pq

        try:
            with fs.open_input_file(path) as f:
                metadata = pq.ParquetFile(f).metadata
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
            return None, f"not a readable Parquet file ({_reason(e)})"
        names = set(metadata.schema.to_arrow_schema().names)
        if missing := [c for c in self.columns or () if c not in names]:
            return None, f"no column {', '.join(map(repr, missing))} (it has {', '.join(sorted(names))})"
        return metadata.num_rows, None

    def read(self, path: str, start: int, stop: int, label: int) -> Row:
        import pyarrow.parquet as pq

        fs, fs_path = _filesystem(path)
        try:
            with fs.open_input_file(fs_path) as f:
                parquet = pq.ParquetFile(f)
                ends = np.cumsum([parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)])
                groups = [g for g in range(len(ends)) if ends[g] > start and ends[g] - _group_rows(ends, g) < stop]
                first = int(ends[groups[0]] - _group_rows(ends, groups[0]))
                table = parquet.read_row_groups(groups, columns=list(self.columns) if self.columns else None)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
            raise BadFile(f"{path}: not a readable Parquet file ({_reason(e)})") from e
        table = table.slice(start - first, stop - start)
        return {name: _numpy(table.column(name)) for name in table.column_names}


@dataclass(frozen=True)
class Blocks(Stream):
    """A materialized Ray Dataset, read as a stream whose "files" are its blocks, already in the object
    store: each rank plans its share as for files and reads those rows itself (`ray.get` of the block,
    zero-copy where the block is on its node). No Ray Data execution, no split coordinator, no dataset
    manager: on a small machine those processes cost a run seconds of its start. `of` lists the
    blocks from the dataset's own metadata; the driver holds the dataset, so the blocks live as long as
    the run."""

    refs: tuple = field(default=(), repr=False)  # ObjectRef of each block
    offsets: tuple[int, ...] = ()  # where each listed block's rows start in it (a bundle may hold a slice)

    read_in_tasks = False

    @classmethod
    def of(cls, dataset: Any) -> Blocks | None:
        """A materialized dataset's blocks, or None where its metadata cannot say (a lazy dataset, or
        Ray Data's internals changed): Ray Train's Ray Data path then reads it."""
        from ray.data.dataset import MaterializedDataset

        if not isinstance(dataset, MaterializedDataset):
            return None
        if (found := ray_compat.blocks(dataset)) is None or any(rows is None for _, _, rows in found):
            return None
        refs, offsets, rows = zip(*found) if found else ((), (), ())
        manifest = Manifest("object store", tuple(map(str, range(len(refs)))), np.array(rows, dtype=np.int64))
        return cls("object store", refs=tuple(refs), offsets=tuple(offsets), manifest=manifest)

    def read(self, path: str, start: int, stop: int, label: int) -> Row:
        import ray
        from ray.data.block import BlockAccessor

        i = int(path)
        block = BlockAccessor.for_block(ray.get(self.refs[i]))
        rows = block.slice(self.offsets[i] + start, self.offsets[i] + stop, copy=False)
        columns = BlockAccessor.for_block(rows).to_batch_format("numpy")
        return {name: np.asarray(column) for name, column in columns.items()}


def row_rng(seed: int, epoch: int, row: int) -> np.random.Generator:
    """The generator a row's transform draws from in an epoch."""
    return np.random.default_rng((seed, epoch, row))


# Files and columns.


def _filesystem(uri: str):
    return storage.locate(storage.absolute(uri))


def _files_under(fs, root: str, extensions: Sequence[str]) -> list[str]:
    import pyarrow.fs

    info = fs.get_file_info(root)
    if info.type == pyarrow.fs.FileType.NotFound:
        raise BadFile(f"{root}: no such directory")
    selector = pyarrow.fs.FileSelector(root, recursive=True)
    return sorted(
        f.path
        for f in fs.get_file_info(selector)
        if f.type == pyarrow.fs.FileType.File and f.path.lower().endswith(tuple(extensions))
    )


def _relative(root: str, path: str) -> str:
    return path[len(root.rstrip("/")) + 1 :]


def _uri(original: str, root: str, path: str) -> str:
    """A listed file as the user named its root: s3://bucket/... stays a URI."""
    if "://" in original:
        return f"{original.split('://')[0]}://{path}"
    return path


def _reason(error: Exception) -> str:
    """An error of Pillow or pyarrow in a few words: its first sentence, without object addresses."""
    text = re.sub(r" ?<[^>]* at 0x[0-9a-f]+>", "", str(error)).split(". ")[0].strip()
    return text[:80] or type(error).__name__


def _group_rows(ends: np.ndarray, g: int) -> int:
    return int(ends[g] - (ends[g - 1] if g else 0))


def _numpy(column) -> np.ndarray:
    """A column as numpy; a list column (lists of one length) as a 2-D array."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        return column.to_numpy(zero_copy_only=False)
    lengths = set(pa.compute.list_value_length(column).to_numpy(zero_copy_only=False).tolist())
    if len(lengths) > 1:
        raise ValueError(f"a list column holds lists of {len(lengths)} lengths: they cannot stack into a batch")
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(len(column), lengths.pop() if lengths else 0)


def length(rows: Row) -> int:
    return len(next(iter(rows.values()))) if rows else 0


def concatenate(parts: list[Row]) -> Row:
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]} if parts else {}
