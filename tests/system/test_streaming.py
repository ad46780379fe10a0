"""Streamed datasets (raytrain_ddp/data/stream.py) end to end, on a local Ray: the two streaming jobs learn
from files the tests write (scikit-learn's digits as PNG files in class folders, and as Parquet
shards), an unreadable file stops a run naming it or is skipped and counted, and a run killed mid-epoch
resumes exactly without reading again what it had trained.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from PIL import Image
from services import user_env
from test_reliability import RELIABLE, _faults, _weights

from raytrain_ddp import ConfigError, RunFailed, load_config
from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config import recipe as recipes

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")
README = Path(__file__).parents[2] / "README.md"
# Tiny's table as 5 Parquet shards a split; each rank's share shuffled in windows of 2 batches.
STREAMED = (*RELIABLE, "dataset.source=parquet", "train.local_shuffle_buffer_size=16", "mlflow.register=never")


def _run(workspace, job: str, *overrides: str):
    from raytrain_ddp import run

    return run(load_config(job, overrides=workspace.overrides(*overrides)))


@pytest.fixture(scope="module")
def straight(ray_session, module_workspace):
    """Tiny's uninterrupted streamed run: 3 epochs of 96 rows, 6 batches a rank an epoch, checkpoints
    at steps 4, 6 | 8, 12 | 16, 18."""
    path = module_workspace.root / "table"
    return _run(module_workspace, TINY, *STREAMED, f"dataset.path={path}", "run.name=straight")


def test_a_run_killed_mid_epoch_resumes_from_its_checkpoint_without_reading_the_trained_rows_again(
    straight, workspace, record
):
    """Rank 1 is SIGKILLed at step 11, 3 steps after the step-8 checkpoint (epoch 2, 2 of its 6
    batches trained): the restarted epoch reads each rank's share from its third batch on, and the run
    ends with the uninterrupted run's weights, bit for bit."""
    path = Path(straight.run_path).parents[1] / "table"  # the same shards
    summary = _run(
        workspace,
        TINY,
        *STREAMED,
        f"dataset.path={path}",
        *_faults(workspace, "'1:11:kill'"),
        "run.max_failures=1",
        "run.name=faulted",
    )

    assert summary.attempts == 2
    assert summary.failures[0].endswith("restarted from epoch_0002-step_0000008")
    run_dir, straight_dir = Path(summary.run_path), Path(straight.run_path)
    torch.testing.assert_close(_weights(run_dir, "epoch_0003"), _weights(straight_dir, "epoch_0003"), rtol=0, atol=0)
    assert summary.final_metrics["train_loss"] == straight.final_metrics["train_loss"]
    # Epoch 2 as its end-of-epoch report saw it: every row trained, only those after the resume point read.
    resumed, whole = (ckpt.open_verified(d / "epoch_0002").metrics() for d in (run_dir, straight_dir))
    assert whole["data_rows_read"] == whole["train_samples"] == 96
    assert resumed["train_samples"] == 96 and resumed["data_rows_read"] == 96 - 2 * 2 * 8  # 2 batches of 8, 2 ranks
    assert resumed["data_bad_files"] == 0
    record(
        "rank 1 SIGKILLed mid-epoch 2, Parquet shards streamed (max_failures=1)",
        attempts=2,
        resumed="epoch_0002-step_0000008 (step 8)",
        note="epoch 2 read 64 of its 96 rows again, not 96 (no replay); weights bit-identical",
    )


@pytest.fixture(scope="module")
def digits_png(tmp_path_factory) -> Path:
    """scikit-learn's digits as PNG files in class folders, as the job's `prepare: digits` writes them."""
    path = tmp_path_factory.mktemp("digits") / "png"
    recipes.load("image_folder").make_datasets(load_config("image_folder", overrides=[f"dataset.path={path}"]))
    return path


# Three of the digits as a user's own classes: RGB files in folders named by the user.
NAMED = {"0": "zero", "1": "one", "2": "two"}


def _named_rgb(digits_png: Path, tmp_path: Path) -> Path:
    """Digits 0, 1 and 2 as RGB PNG files in the folders `NAMED` gives them."""
    for png in digits_png.glob("*/[012]/*.png"):
        split, digit = png.parts[-3], png.parts[-2]
        folder = tmp_path / "images" / split / NAMED[digit]
        folder.mkdir(parents=True, exist_ok=True)
        Image.open(png).convert("RGB").save(folder / png.name)
    return tmp_path / "images"


def _readme(job: str) -> tuple[list[str], str]:
    """The README's "Your own images or table" for `job`: its command's overrides, and the Python that
    calls its model (the statements after the other job's call, up to its own)."""
    section = README.read_text().split("## Your own images or table", 1)[1].split("\n## ", 1)[0]
    command = re.search(rf"^raytrain-ddp train {job} (.*)$", section, re.M).group(1).split()
    [python] = re.findall(r"```python\n(.*?)```", section, re.S)
    statements, own = [], []
    for statement in ast.parse(python).body:
        own.append(ast.get_source_segment(python, statement))
        if "load_model(" in own[-1]:
            statements.append(own)
            own = []
    [calls] = [lines for lines in statements if job.replace("_", "-") in lines[-1]]
    return command, "\n".join(calls)


def _answers(python: str, namespace: dict) -> object:
    """What the README's Python gives: its last line is the expression that answers."""
    module = ast.parse(python)
    module.body[-1] = ast.Assign([ast.Name("answers", ast.Store())], module.body[-1].value, lineno=0)
    exec(compile(ast.fix_missing_locations(module), "README.md", "exec"), namespace)
    return namespace["answers"]


def test_image_folder_learns_from_png_files_skips_a_corrupt_one_and_serves_raw_images(
    ray_session, workspace, tmp_path, digits_png, capsys
):
    """Three classes of RGB PNG files, plus one that is not an image, trained as the README's "Your
    own images" says (its command, with small images for time) and no model settings: the data gives
    a 3-class, 3-channel model and the classes' names. With data.max_bad_files=1 the run trains,
    counts the broken file in every report and in MLflow, names it in its summary and in an MLflow
    artifact, and learns; the registered model, called as the README calls it, answers raw decoded
    images with their classes and scores by name, and a single image with a short message."""
    images = _named_rgb(digits_png, tmp_path)
    (images / "train" / "two" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    command, python = _readme("image_folder")
    assert {"dataset.prepare=none", "dataset.grayscale=false", "dataset.size=[64,64]"} <= set(command), command
    readme = [o for o in command if not o.startswith(("dataset.path=", "dataset.size="))]
    started = time.perf_counter()
    summary = _run(
        workspace,
        "image_folder",
        *readme,
        f"dataset.path={images}",
        "dataset.size=[8,8]",
        "train.epochs=6",
        "data.max_bad_files=1",
    )
    wall_s = time.perf_counter() - started

    said = capsys.readouterr().out
    names = ["one", "two", "zero"]  # the folders' names, sorted: outputs 0, 1, 2
    assert "from the data: model.num_classes=3, model.channels=3, data.class_names=[one, two, zero]" in said
    assert summary.final_metrics["val_accuracy"] >= 0.85, summary.final_metrics
    assert summary.final_metrics["data_bad_files"] == 1
    train_files = sum(1 for _ in (images / "train").rglob("*.png"))  # the broken one included
    assert summary.final_metrics["train_samples"] == train_files // 2 * 2 - 1  # equal shares, less the broken row
    client = mlflow.tracking.MlflowClient(summary.tracking_uri)
    history = client.get_metric_history(summary.mlflow_run_id, "data_bad_files")
    assert [m.value for m in history] == [1.0] * 6  # one per epoch's report
    broken = f"train: {images / 'train' / 'two' / 'broken.png'}: unreadable when read"
    assert summary.skipped_files == [broken]
    row = r"^  skipped files +1 unreadable, left out: train: .*broken\.png: unreadable when read \(all: MLflow "
    assert re.search(row, said, re.M), said[-3000:]
    logged = client.get_run(summary.mlflow_run_id).data
    assert logged.tags["raytrain_ddp.skipped_files"] == "1" and "data.skipped_files" not in logged.params
    assert client.download_artifacts(summary.mlflow_run_id, "skipped_files.txt", str(tmp_path)).endswith(".txt")
    assert (tmp_path / "skipped_files.txt").read_text() == broken + "\n"
    version = client.get_model_version(summary.model.name, str(summary.model.version))
    assert json.loads(version.tags["raytrain_ddp.class_names"]) == names
    client.download_artifacts(summary.mlflow_run_id, "class_names.json", str(tmp_path))
    assert json.loads((tmp_path / "class_names.json").read_text()) == names
    mlflow.set_tracking_uri(summary.tracking_uri)
    pngs = sorted((images / "val").rglob("*.png"))[::3]
    sized = python.replace("(64, 64)", "(8, 8)")  # the size trained here
    answers = _answers(sized, {"np": np, "Image": Image, "mlflow": mlflow, "files": pngs})
    assert list(answers.columns) == ["class", *names]
    assert (answers["class"] == answers[names].idxmax(axis=1)).all()
    assert np.mean([name == p.parent.name for name, p in zip(answers["class"], pngs)]) >= 0.8
    model = mlflow.pyfunc.load_model(summary.model.uri)
    one = np.asarray(Image.open(pngs[0]).convert("RGB").resize((8, 8)))
    with pytest.raises(Exception, match=r"expects a batch of rows of 8 × 8 × 3 .*got an input of shape \(8, 8, 3\)"):
        model.predict(one)  # one image, not a batch
    print(f"image_folder: {train_files} train files, 6 epochs, {wall_s:.0f} s, {summary.final_metrics}")


def test_a_corrupt_image_stops_the_run_naming_it(ray_session, workspace, tmp_path, digits_png):
    images = tmp_path / "images"  # 2 classes of 16 images a split: the run fails at its first validation
    for png in sorted(digits_png.glob("*/[01]/*.png")):
        folder = images / png.parent.relative_to(digits_png)
        if len(list(folder.glob("*.png"))) < 16:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(png, folder)
    (images / "val" / "1" / "broken.png").write_bytes(b"not an image at all")
    with pytest.raises(RunFailed) as failed:
        _run(workspace, "image_folder", f"dataset.path={images}", "dataset.size=[8,8]", "train.batch_size=8")
    message = str(failed.value)
    assert "val/1/broken.png: not a readable image" in message
    assert "data.max_bad_files" in message


def _wine_parquet(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's wine table as a user's own Parquet shards (3 a split, with an id and a source
    column the job must not read); returns the validation rows and labels."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_wine

    features, labels = load_wine(return_X_y=True)
    in_val = np.arange(len(labels)) % 4 == 0
    for split, rows in (("train", np.flatnonzero(~in_val)), ("val", np.flatnonzero(in_val))):
        (root / split).mkdir(parents=True)
        for k, part in enumerate(np.array_split(rows, 3)):
            columns = {"id": part, "features": list(features[part].astype(np.float32)), "label": labels[part]}
            pq.write_table(pa.table(columns | {"source": ["load_wine"] * len(part)}), root / split / f"{k}.parquet")
    return features[in_val].astype(np.float32), labels[in_val]


def test_parquet_table_on_a_users_shards_reads_only_its_columns_serves_named_classes_and_refuses_a_truncated_shard(
    ray_session, workspace, tmp_path, capsys
):
    """The README's "your own table": wine's 3 classes as Parquet shards, trained with its command (the
    class names included) and no model settings: the shards give 13 features and 3 classes; the
    registered model, called with the README's Python and with its HTTP request (MLflow's scoring
    server, the app `mlflow models serve` runs, called in-process), answers raw rows by class name."""
    from fastapi.testclient import TestClient
    from mlflow.pyfunc import scoring_server

    table = tmp_path / "table"
    rows, labels = _wine_parquet(table)
    command, python = _readme("parquet_table")
    assert {"dataset.prepare=none", "dataset.path=table"} <= set(command), command
    [named] = [o for o in command if o.startswith("data.class_names=")]
    names = named.split("=", 1)[1].strip("[]").split(",")
    readme = [o for o in command if o != "dataset.path=table"]
    summary = _run(workspace, "parquet_table", *readme, f"dataset.path={table}", "train.batch_size=8", "train.epochs=8")

    assert "from the data: model.num_features=13, model.num_classes=3" in capsys.readouterr().out
    assert summary.final_metrics["val_accuracy"] >= 0.9, summary.final_metrics
    mlflow.set_tracking_uri(summary.tracking_uri)
    answers = _answers(python, {"mlflow": mlflow, "rows": rows})
    assert list(answers.columns) == ["class", *names]
    assert np.mean(answers["class"].to_numpy() == np.array(names)[labels]) >= 0.9
    http = re.search(r"POST `(.*?)`\s+to `(/invocations)`", README.read_text())
    assert http.group(1) == '{"inputs": rows.tolist()}'
    served = TestClient(scoring_server.init(mlflow.pyfunc.load_model(summary.model.uri))).post(
        http.group(2), json={"inputs": rows.tolist()}
    )
    assert served.status_code == 200, served.text
    predictions = served.json()["predictions"]
    assert [p["class"] for p in predictions] == answers["class"].tolist()
    assert set(predictions[0]) == {"class", *names}

    shard = table / "train" / "2.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / "again").mkdir()
    again = type(workspace)(tmp_path / "again", workspace.store)  # a workspace that nothing has written to
    with pytest.raises(ConfigError, match=r"2\.parquet: not a readable Parquet file.*data\.max_bad_files=1"):
        _run(again, "parquet_table", f"dataset.path={table}", "dataset.prepare=none")
    assert again.untouched()


# A Ray of its own, its object store held to STORE_MB, and a table of TABLE_MB in Parquet shards.
STORE_MB, ROWS, FEATURES = 96, 50_000, 2048  # 50,000 rows of 2,048 float32: 400 MB, over 4 stores full
BOUNDED = """
import json, re, resource, sys, threading, time
import ray
from ray._private.internal_api import memory_summary

from raytrain_ddp import load_config, run
from raytrain_ddp.cluster.session import OWN_RAY

ray.init(object_store_memory={store} * 2**20, log_to_driver=False, **OWN_RAY)

address = ray.get_runtime_context().gcs_address  # this Ray's: the test session may run another

peak, done = [0.0], threading.Event()
def watch():  # the object store's use, every 0.2 s, from the raylet's own figures
    while not done.wait(0.2):
        used = re.search(r"Plasma memory usage (\\d+) MiB", memory_summary(address, stats_only=True))
        peak[0] = max(peak[0], float(used.group(1)) if used else 0.0)
threading.Thread(target=watch, daemon=True).start()
summary = run(load_config("parquet_table", overrides=sys.argv[1:]))
done.set()
spilled = re.search(r"Spilled (\\d+) MiB", memory_summary(address, stats_only=True))
print(json.dumps({{
    "store_peak_mb": peak[0],
    "spilled_mb": float(spilled.group(1)) if spilled else 0.0,
    "driver_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "worker_rss_mb": summary.final_metrics["peak_memory_mb"],
    "train_samples": summary.final_metrics["train_samples"],
    "samples_per_s": summary.final_metrics["samples_per_s"],
}}))
"""


def test_a_table_four_times_the_object_store_streams_through_it_without_spilling(tmp_path, record):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for split, rows, shards in (("train", ROWS, 40), ("val", 1000, 1)):
        (tmp_path / "table" / split).mkdir(parents=True)
        for k in range(shards):
            n = rows // shards
            features = pa.FixedSizeListArray.from_arrays(rng.normal(size=n * FEATURES).astype(np.float32), FEATURES)
            table = pa.table({"features": features, "label": rng.integers(0, 10, n)})
            pq.write_table(table, tmp_path / "table" / split / f"part-{k:03d}.parquet", compression="none")
    table_mb = sum(f.stat().st_size for f in (tmp_path / "table" / "train").iterdir()) / 2**20
    overrides = [
        f"dataset.path={tmp_path / 'table'}",
        "dataset.prepare=none",
        f"model.num_features={FEATURES}",
        "model.hidden=32",
        "train.epochs=1",
        "train.batch_size=256",
        "mlflow.register=never",
        f"run.storage_path={tmp_path / 'runs'}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    script = BOUNDED.format(store=STORE_MB)
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", script, *overrides], env=user_env(), capture_output=True, text=True, timeout=600
    )
    wall_s = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.splitlines()[-1])

    assert table_mb > 4 * STORE_MB
    assert figures["train_samples"] == ROWS  # every row, once
    assert figures["spilled_mb"] == 0, figures  # held back by Ray Data's backpressure, not spilled to disk
    assert figures["store_peak_mb"] <= STORE_MB
    print(f"bounded memory: {table_mb:.0f} MB through a {STORE_MB} MB object store in {wall_s:.0f} s: {figures}")
    record(
        f"{table_mb:.0f} MB of Parquet streamed through a {STORE_MB} MB object store",
        attempts=1,
        note=f"object store peak {figures['store_peak_mb']:.0f} MB, spilled 0; RSS driver "
        f"{figures['driver_rss_mb']:.0f} MB, worker {figures['worker_rss_mb']:.0f} MB",
    )
