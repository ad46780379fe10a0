"""Streamed data on this machine, in two figures:

1. Throughput of the image_folder job over the same image files read three ways (bench/image_sides.py):
   streamed (the job), materialized in Ray's object store, and a torch DataLoader with worker
   processes; samples/s and each worker's share of time waiting for data, in the last epoch.
2. A resumed epoch's time to its first batch, late in a large Parquet table: the stream starts reading
   where the epoch stopped; replaying reads the epoch from its start and passes over what it trained
   (what a Ray Dataset or a torch Dataset does on resume).

    .venv/bin/python bench/streaming.py                      # ~5 min on 2 cores
    .venv/bin/python bench/streaming.py --rounds 3 --copies 3

The images are scikit-learn's digits as PNG files (`--copies` times over, each copy a new file), the
table random numbers; both written to a temporary directory. Results: bench/results/streaming-<machine>.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).parent
SIDES = ("stream", "memory", "dataloader")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every side (and of each resume)")
    parser.add_argument("--copies", type=int, default=3, help="copies of the digits' 1,797 images")
    parser.add_argument("--rows", type=int, default=400_000, help="rows of the resume benchmark's table")
    parser.add_argument("--out", default=str(BENCH / "results"))
    args = parser.parse_args(argv)

    import ray

    ray.init(log_to_driver=False, logging_level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as work:
        work = Path(work)
        files = write_images(work / "images", args.copies)
        throughput = {side: [train(side, work, round_) for round_ in range(args.rounds)] for side in SIDES}
        resume = resume_times(work / "table", args.rows, args.rounds)
    results = {
        "machine": platform.node(),
        "cpus": ray.cluster_resources().get("CPU"),
        "images": files,
        "throughput": throughput,
        "resume": resume,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"streaming-{'cpu-2core' if results['cpus'] == 2 else platform.node()}"
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (out / f"{name}.md").write_text(table)
    print(table)
    return 0


def write_images(root: Path, copies: int) -> int:
    """The digits as PNG files in class folders, `copies` times (copy k shifted by k pixels: new files)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    n = 0
    for copy in range(copies):
        for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
            split = "val" if i % 5 == 0 else "train"
            if split == "val" and copy:
                continue
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            image = np.roll((pixels * 16).clip(0, 255).astype(np.uint8), copy, axis=1)
            Image.fromarray(image, mode="L").save(folder / f"{copy}-{i:04d}.png")
            n += 1
    return n


def train(side: str, work: Path, round_: int) -> dict:
    from raytrain_ddp import load_config, run

    overrides = [
        f"dataset.path={work / 'images'}",
        f"dataset.kind={side}",
        f"run.name={side}-{round_}",
        f"run.storage_path={work / 'runs'}",
        f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}",
        *(["train.num_loader_workers=2"] if side == "dataloader" else []),
    ]
    from io import StringIO

    from rich.console import Console

    summary = run(load_config(str(BENCH / "image_sides.py"), overrides=overrides), console=Console(file=StringIO()))
    m = summary.final_metrics
    figures = {
        "samples_per_s": m["samples_per_s"],
        "data_wait_per_worker": m["data_wait_fraction_per_worker"],
        "epoch_s": m["epoch_time_s"],
        "val_accuracy": m["val_accuracy"],
    }
    print(side, round_, figures, flush=True)
    return figures


def resume_times(root: Path, rows: int, rounds: int) -> dict:
    """Rank 0 of 2 resuming epoch 0 at 90 % of its batches: time to that batch, reading from there
    (the stream) and reading the epoch from its start (a replay)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_ddp.config.schema import DataSettings
    from raytrain_ddp.data import stream
    from raytrain_ddp.data.pipeline import Pipeline

    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    shards, width = 40, 64
    for k in range(shards):
        n = rows // shards
        features = pa.FixedSizeListArray.from_arrays(rng.normal(size=n * width).astype(np.float32), width)
        pq.write_table(
            pa.table({"features": features, "label": rng.integers(0, 10, n)}), root / f"part-{k:03d}.parquet"
        )
    table = stream.Parquet(str(root), columns=("features", "label")).listed(max_bad_files=0)
    pipeline = Pipeline(table, 0, 2, seed=0, batch_size=256, data=DataSettings(), shuffle=True, shuffle_rows=1024)
    batches = rows // 2 // 256
    at = int(batches * 0.9)
    times = {"stream": [], "replay": []}
    for _ in range(rounds):
        for how in times:
            started = time.perf_counter()
            if how == "stream":
                first = next(pipeline.batches(0, at))
            else:
                first = next(itertools.islice(pipeline.batches(0, 0), at, None))
            times[how].append(time.perf_counter() - started)
            assert len(first["label"]) == 256
    print("resume", times, flush=True)
    return {"rows": rows, "batches": batches, "resumed_at": at, "seconds": times}


def markdown(results: dict) -> str:
    def spread(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}–{max(values):{fmt}}]"

    t = results["throughput"]
    rounds = len(next(iter(t.values())))
    lines = [
        f"### Streamed data: {results['machine']}, {results['cpus']:g} CPUs",
        "",
        f"The image_folder job (ResNet-18, 16×16 grayscale, 2 workers × ½ CPU, batch 32) on {results['images']:,} PNG "
        f"files, last of 2 epochs, median [min–max] of {rounds} round(s):",
        "",
        "| read | samples/s | waiting for data, per worker | epoch, s | val accuracy |",
        "|---|---|---|---|---|",
    ]
    for side, runs in t.items():
        waits = [w for r in runs for w in r["data_wait_per_worker"]]
        lines.append(
            f"| {side} | {spread([r['samples_per_s'] for r in runs], ',.0f')} | {spread(waits, '.0%')} "
            f"| {spread([r['epoch_s'] for r in runs], '.1f')} | {spread([r['val_accuracy'] for r in runs], '.3f')} |"
        )
    r = results["resume"]
    lines += [
        "",
        f"Time to the first batch of an epoch resumed at batch {r['resumed_at']:,} of {r['batches']:,} (rank 0 of 2, "
        f"{r['rows']:,} rows of 64 float32 in 40 Parquet shards, batch 256):",
        "",
        "| resume | seconds |",
        "|---|---|",
        *(f"| {how} | {spread(seconds, '.2f')} |" for how, seconds in r["seconds"].items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
