"""Streamed datasets without Ray: listing files (and refusing the unreadable ones), each rank's share of
an epoch, and its batches from the rows `read_pieces` reads (the function Ray Data's tasks run, run
here in-process): every row once an epoch, the same batches in every run, and a resumed epoch that
reads only from where it stopped."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raytrain_ddp.config.schema import DataSettings
from raytrain_ddp.data import stream
from raytrain_ddp.data.epoch import EpochPlan
from raytrain_ddp.data.pipeline import Pipeline, read_pieces

pytestmark = pytest.mark.unit


def write_shards(root, sizes: list[int], width: int = 3) -> None:
    """Parquet shards of `sizes` rows: `id` (the row's global index, files in name order), `x` (a list
    column of `width` floats derived from it), `label`, and a `note` no reader asks for."""
    root.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        table = pa.table(
            {
                "id": ids,
                "x": list(np.stack([ids * 1.0, ids * 2.0, ids * 3.0][:width], axis=1).astype(np.float32)),
                "label": ids % 2,
                "note": ["unused"] * n,
            }
        )
        pq.write_table(table, root / f"part-{k:03d}.parquet", row_group_size=4)
        start += n


def read_locally(pipeline: Pipeline, plan: EpochPlan) -> list[dict[str, np.ndarray]]:
    """The blocks Ray Data would hand the rank: `read_pieces` on the plan's pieces, a few at a time."""
    columns = ("path", "label", "start", "stop", "position", "first_row")
    blocks = []
    for i in range(0, len(plan.pieces), 3):
        chunk = plan.pieces[i : i + 3]
        batch = {name: np.array([getattr(p, name) for p in chunk]) for name in columns}
        skip = pipeline.data.max_bad_files > 0
        blocks.append(read_pieces(batch, pipeline.stream, pipeline.seed, plan.epoch, skip))
    return blocks


def epoch_ids(source: stream.Stream, world: int, epoch: int, first_batch: int = 0, **kwargs) -> list[list[list[int]]]:
    """Each rank's batches of `epoch` as lists of row ids."""
    out = []
    for rank in range(world):
        pipeline = Pipeline(source, rank, world, seed=7, batch_size=4, data=DataSettings(), **kwargs)
        plan = pipeline.plan(epoch, first_batch)
        out.append([batch["id"].tolist() for batch in pipeline.batched(plan, read_locally(pipeline, plan))])
    return out


@pytest.fixture
def shards(tmp_path):
    write_shards(tmp_path / "train", [5, 9, 1, 12, 6, 7])  # 40 rows, files of uneven sizes
    return stream.Parquet(str(tmp_path / "train"), columns=("id", "x", "label")).listed(max_bad_files=0)


def test_parquet_listing_reads_rows_from_the_footers_and_only_the_asked_columns(shards):
    assert list(shards.manifest.rows) == [5, 9, 1, 12, 6, 7] and shards.manifest.total == 40
    first = shards.example(6, seed=0)
    assert sorted(first) == ["id", "label", "x"]  # no `note`
    assert list(first["id"]) == [0, 1, 2, 3, 4, 5] and first["x"].shape == (6, 3)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_row_once_an_epoch_equal_shares_and_another_order_each_epoch(shards, world):
    orders = []
    for epoch in (0, 1):
        ranks = epoch_ids(shards, world, epoch, shuffle=True, shuffle_rows=8)
        seen = [i for batches in ranks for batch in batches for i in batch]
        assert len(seen) == len(set(seen)) == 40 // world * world  # each at most once; world - 1 left out
        assert len({sum(len(b) for b in batches) for batches in ranks}) == 1  # equal shares
        assert len({len(batches) for batches in ranks}) == 1  # the same number of batches on every rank
        orders.append(seen)
    assert orders[0] != orders[1]


def test_the_same_batches_in_every_run(shards):
    one = epoch_ids(shards, 2, epoch=3, shuffle=True, shuffle_rows=8)
    two = epoch_ids(shards, 2, epoch=3, shuffle=True, shuffle_rows=8)
    assert one == two


def test_a_resumed_epoch_reads_from_its_window_and_continues_with_the_same_batches(shards):
    whole = epoch_ids(shards, 2, epoch=1, shuffle=True, shuffle_rows=8)
    for first in (1, 2, 3, 4):
        resumed = epoch_ids(shards, 2, epoch=1, first_batch=first, shuffle=True, shuffle_rows=8)
        assert resumed == [batches[first:] for batches in whole]
    pipeline = Pipeline(shards, 0, 2, seed=7, batch_size=4, data=DataSettings(), shuffle=True, shuffle_rows=8)
    plan = pipeline.plan(1, first_batch=4)  # batch 4 = rows 16..19 of 20: in the window of rows 16..23
    assert plan.skip == 16 and sum(p.stop - p.start for p in plan.pieces) == 4  # 16 of 20 rows never read


def test_batches_grouped_by_length_are_each_windows_rows_sorted_into_batches_and_resume_exactly(shards):
    """train.group_by_length, with the row id as each row's length: every shuffle window (12 rows, 3
    batches) holds the rows it holds without grouping, in batches of consecutive lengths, the batches in
    a seeded order, not the sorted one, the same on every rank (each step's batches hold the same length
    rank on every rank, so none waits for another); a resumed epoch trains the same batches from where it
    stopped."""
    plain = epoch_ids(shards, 2, epoch=2, shuffle=True, shuffle_rows=12)
    grouped = epoch_ids(shards, 2, epoch=2, shuffle=True, shuffle_rows=12, group_by="id")
    descending, length_ranks = [], []
    for rank_plain, rank_grouped in zip(plain, grouped):
        assert [len(b) for b in rank_grouped] == [len(b) for b in rank_plain] == [4] * 5  # 20 rows a rank
        length_ranks.append([])
        for w in (0, 3):  # the windows' first batches: 12 rows, then 8
            window = sorted(i for b in rank_plain[w : w + 3] for i in b)
            regrouped = rank_grouped[w : w + 3] if w == 0 else rank_grouped[3:]
            assert sorted(sorted(b) for b in regrouped) == [window[k : k + 4] for k in range(0, len(window), 4)]
            descending.append([max(b) for b in regrouped] == sorted((max(b) for b in regrouped), reverse=True))
            length_ranks[-1] += [sorted((max(b) for b in regrouped), reverse=True).index(max(b)) for b in regrouped]
    assert not all(descending)  # the batches' order is shuffled, not by length
    assert length_ranks[0] == length_ranks[1]  # step by step, the ranks' batches are of the same length rank
    assert epoch_ids(shards, 2, epoch=2, shuffle=True, shuffle_rows=12, group_by="id") == grouped  # seeded
    for first in (1, 2, 3, 4):
        resumed = epoch_ids(shards, 2, epoch=2, first_batch=first, shuffle=True, shuffle_rows=12, group_by="id")
        assert resumed == [batches[first:] for batches in grouped]


def test_validation_covers_every_row_in_file_order(shards):
    ranks = epoch_ids(shards, 3, epoch=0, equal=False)
    assert [i for batches in ranks for batch in batches for i in batch] == list(range(40))


def test_drop_last_drops_a_short_last_batch(shards):
    [batches] = epoch_ids(shards, 1, epoch=0, shuffle=False, drop_last=True)  # 40 rows, batches of 4: none short
    assert len(batches) == 10
    [batches] = epoch_ids(shards, 3, epoch=0, shuffle=False, drop_last=True)[:1]  # 13 rows a rank
    assert [len(b) for b in batches] == [4, 4, 4]


def test_a_damaged_shard_or_a_missing_column_is_named_and_refused_unless_allowed(tmp_path):
    write_shards(tmp_path / "t", [4, 4, 4])
    good = (tmp_path / "t" / "part-001.parquet").read_bytes()
    (tmp_path / "t" / "part-001.parquet").write_bytes(good[: len(good) // 2])  # truncated: no footer
    pq.write_table(pa.table({"id": [99]}), tmp_path / "t" / "part-003.parquet")  # no x, no label
    source = stream.Parquet(str(tmp_path / "t"), columns=("id", "x", "label"))
    with pytest.raises(stream.BadFile) as refused:
        source.listed(max_bad_files=1)
    message = str(refused.value)
    assert "2 unreadable file(s)" in message and "data.max_bad_files=2" in message
    assert "part-001.parquet: not a readable Parquet file" in message
    assert "part-003.parquet: no column 'x', 'label' (it has id)" in message
    allowed = source.listed(max_bad_files=2)
    assert list(allowed.manifest.rows) == [4, 4] and len(allowed.manifest.skipped) == 2


def write_images(root, per_class: dict[str, int], corrupt: set[str] = frozenset()) -> None:
    """8x8 grayscale PNGs whose every pixel is the image's index; `corrupt` names are not images."""
    index = 0
    for label, n in per_class.items():
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            name = f"{label}-{i}"
            path = root / label / f"{name}.png"
            if name in corrupt:
                path.write_bytes(b"\x89PNG\r\n\x1a\n not really")
            else:
                Image.fromarray(np.full((8, 8), index, dtype=np.uint8), mode="L").save(path)
            index += 1


def test_image_folder_labels_by_class_folder_and_decodes_resized(tmp_path):
    write_images(tmp_path, {"cat": 3, "dog": 2})
    images = stream.ImageFolder(str(tmp_path), size=(4, 6), mode="L").listed(max_bad_files=0)
    assert images.manifest.classes == ("cat", "dog") and images.manifest.labels.tolist() == [0, 0, 0, 1, 1]
    rows = images.example(5, seed=0)
    assert rows["image"].shape == (5, 4, 6) and rows["image"].dtype == np.uint8
    assert rows["label"].tolist() == [0, 0, 0, 1, 1] and rows["image"][3].max() == 3


def test_a_corrupt_image_stops_the_read_named_or_is_skipped_and_named_with_the_batch_a_row_short(tmp_path):
    write_images(tmp_path, {"a": 6, "b": 6}, corrupt={"b-2"})
    images = stream.ImageFolder(str(tmp_path), mode="L").listed(max_bad_files=0)  # listing does not decode
    pipeline = Pipeline(images, 0, 1, seed=0, batch_size=4, data=DataSettings(), shuffle=False)
    with pytest.raises(stream.BadFile, match=r"b-2\.png: not a readable image .*data\.max_bad_files"):
        read_locally(pipeline, pipeline.plan(0))
    pipeline = Pipeline(images, 0, 1, seed=0, batch_size=4, data=DataSettings(max_bad_files=1), shuffle=False)
    plan = pipeline.plan(0)
    batches = list(pipeline.batched(plan, read_locally(pipeline, plan)))
    assert [len(b["label"]) for b in batches] == [4, 4, 3]  # the batch count holds; one row short
    assert {p.rsplit("/", 1)[1] for p in pipeline.bad_files} == {"b-2.png"}


def test_a_transform_draws_from_the_rows_own_generator(tmp_path):
    write_images(tmp_path, {"a": 4})

    def jitter(row, rng):
        return {"image": row["image"] + rng.integers(0, 100, dtype=np.uint8), "label": row["label"]}

    images = stream.ImageFolder(str(tmp_path), mode="L", transform=jitter).listed(max_bad_files=0)
    rows = images.example(4, seed=3)
    expected = [i + stream.row_rng(3, 0, i).integers(0, 100, dtype=np.uint8) for i in range(4)]
    assert [int(r[0, 0]) for r in rows["image"]] == [int(e) for e in expected]
    assert not np.array_equal(images.example(4, seed=4)["image"], rows["image"])
