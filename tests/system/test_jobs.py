"""Every job in jobs/ trains on 2 CPU workers and meets its quality bar. (That every job's YAML loads
is tests/unit/test_job_configs.py's.)

Data that does not ship with scikit-learn is written by the tests in the format the job reads: IDX
files (FashionMNIST's format, here holding scikit-learn's real digit scans), a generated text, and a
Parquet interactions table with a planted preference structure.
"""

from __future__ import annotations

import gzip
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from raytrain_ddp import ConfigError, load_config
from raytrain_ddp.config import recipe as recipes


def test_a_dataset_path_without_the_data_is_refused_before_anything_is_written(ray_session, workspace, tmp_path):
    from raytrain_ddp import run

    cases = {
        "char_gpt": (f"dataset.path={tmp_path}/missing.txt", r"no such text file"),
        "fashion_mnist": (f"dataset.path={tmp_path}", r"no train-images-idx3-ubyte .*set dataset.download=true"),
    }
    for job, (override, message) in cases.items():
        with pytest.raises(
            ConfigError,
            match=rf"recipe {job}: build_datasets \(.*line \d+: .*\) failed: FileNotFoundError: .*{message}",
        ):
            run(load_config(job, overrides=workspace.overrides(override)))
    assert workspace.untouched()


def _train(workspace, job: str, *overrides: str):
    from raytrain_ddp import run

    return run(load_config(job, overrides=workspace.overrides(*overrides)))


def _served(summary, job: str, *overrides: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The registered model's answers to the job's validation rows, raw as the job reads them (the
    model standardizes, reshapes and scales them itself), and those rows."""
    import mlflow

    config = load_config(job, overrides=list(overrides))
    val = recipes.load(job).make_datasets(config)["val"]
    rows = val.take_batch(val.count(), batch_format="numpy")
    mlflow.set_tracking_uri(summary.tracking_uri)
    model = mlflow.pyfunc.load_model(summary.model.uri)
    return model.predict(recipes.load(job).model_input({k: v.copy() for k, v in rows.items()})), rows


@pytest.mark.smoke  # the one end-to-end run of `make test-quick`: plan, checks, fit, register, summary
def test_breast_cancer_counts_every_sample_and_batch_and_reaches_93_percent(ray_session, workspace):
    summary = _train(workspace, "breast_cancer")

    # 455 training rows, 227 per worker, 28 batches of 8 each with drop_last: 56 batches, 448 samples.
    final = summary.final_metrics
    assert (final["train_samples"], final["train_batches"], final["train_samples_per_worker"]) == (448, 56, [224, 224])
    assert final["val_samples"] == 114
    assert summary.metrics["val_accuracy"] >= 0.93
    answers, rows = _served(summary, "breast_cancer")
    assert rows["x"].max() > 100  # raw measurements (areas in the hundreds), not standardized ones
    assert (answers.argmax(axis=1) == rows["y"]).mean() == pytest.approx(summary.metrics["val_accuracy"], abs=1e-9)


def test_regression_mlp_beats_predicting_the_mean(ray_session, workspace):
    summary = _train(workspace, "regression")

    assert summary.metrics["val_samples"] == 89
    assert summary.metrics["val_mse"] < 0.7 * summary.metrics["val_baseline_mse"]
    answers, rows = _served(summary, "regression")  # raw measurements in, the target's units out
    assert ((answers - rows["y"]) ** 2).mean() == pytest.approx(summary.metrics["val_mse"], rel=1e-4)


def test_fashion_mnist_reads_idx_files_from_the_dataset_path_and_learns(ray_session, workspace, tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.pad(np.kron(digits.images, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))  # 8x8 -> 28x28
    images = (images * 255 / 16).astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    data = tmp_path / "fashion"
    data.mkdir()
    _write_idx(data / "train-images-idx3-ubyte.gz", images[:700])  # gzipped, as downloaded
    _write_idx(data / "train-labels-idx1-ubyte.gz", labels[:700])
    _write_idx(data / "t10k-images-idx3-ubyte", images[1400:])  # and plain
    _write_idx(data / "t10k-labels-idx1-ubyte", labels[1400:])

    # ResNet-18 on 28x28 is the suite's costliest model per row: few rows, small batches (enough steps
    # for BatchNorm's running statistics), two epochs.
    overrides = ("train.epochs=2", "train.batch_size=32", "train.warmup_steps=5")
    summary = _train(workspace, "fashion_mnist", f"dataset.path={data}", *overrides)

    assert summary.metrics["val_samples"] == len(images) - 1400
    assert summary.metrics["val_accuracy"] >= 0.8  # 10 classes: chance is 0.1
    answers, rows = _served(summary, "fashion_mnist", f"dataset.path={data}")  # uint8 images, as in the files
    assert rows["image"].dtype == np.uint8 and rows["image"].shape[1:] == (28, 28)
    assert (answers.argmax(axis=1) == rows["label"]).mean() == pytest.approx(summary.metrics["val_accuracy"], abs=1e-9)


def test_char_gpt_learns_a_text_reports_tokens_and_logs_a_sample(ray_session, workspace, tmp_path):
    from mlflow.tracking import MlflowClient

    text = tmp_path / "input.txt"
    text.write_text(_generated_text(words=12_000, seed=0))

    # Small batches: more optimizer steps for the same compute, enough to learn the text in 3 epochs.
    settings = ("dataset.stride=32", "train.epochs=3", "train.batch_size=16")
    summary = _train(workspace, "char_gpt", f"dataset.path={text}", *settings)

    final = summary.final_metrics
    assert final["train_tokens"] == final["train_samples"] * 64 and final["tokens_per_s"] > 0
    windows = recipes.load("char_gpt").build_datasets(seed=0, path=str(text), stride=32)
    assert final["val_samples"] == len(windows["val"])  # torch Dataset path: each window counted once
    assert summary.metrics["val_loss"] < 1.4  # nats per byte; uniform over the text's ~30 symbols is 3.4
    sample = MlflowClient(summary.tracking_uri).download_artifacts(summary.mlflow_run_id, "sample.txt", str(tmp_path))
    assert summary.artifacts == ["sample.txt"] and len(Path(sample).read_text()) > 100


def test_two_tower_recall_at_10_beats_the_popularity_baseline(ray_session, workspace, tmp_path):
    table = tmp_path / "interactions.parquet"
    _write_interactions(table, users=1000, items=500, groups=20, per_user=24, seed=0)

    summary = _train(workspace, "two_tower", f"dataset.path={table}", "mlflow.register=never")

    recall, popularity = summary.metrics["val_recall_at_10"], summary.metrics["val_popularity_recall_at_10"]
    assert summary.metrics["val_samples"] == 2400
    assert recall > 2 * popularity and recall > 0.3


# ---- data the tests write ------------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format: two zero bytes, 0x08 (unsigned bytes), the number of dimensions, each as a
    big-endian int32, then the data."""
    raw = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def _generated_text(words: int, seed: int) -> str:
    """Sentences from a small grammar: structure a language model can learn in a few epochs."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "our teacher", "a small bird"]
    verbs = ["sees", "likes", "follows", "finds", "carries", "watches"]
    objects = ["the ball", "a red apple", "the river", "an open door", "the green hat", "a long road"]
    out, count = [], 0
    while count < words:
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
        out.append(sentence.capitalize())
        count += len(sentence.split())
    return "\n".join(" ".join(out[i : i + 3]) for i in range(0, len(out), 3)) + "\n"


def _write_interactions(path: Path, users: int, items: int, groups: int, per_user: int, seed: int) -> None:
    """Users and items fall into `groups` taste groups; a user picks 90% of its items from its own
    group (some items a little more often than others) and 10% anywhere, so taste beats popularity."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    user_group = rng.integers(groups, size=users)
    item_group = np.arange(items) % groups
    popularity = rng.uniform(0.5, 2.0, size=items)
    rows_user, rows_item = [], []
    for user in range(users):
        own = np.flatnonzero(item_group == user_group[user])
        for _ in range(per_user):
            pool = own if rng.random() < 0.9 else np.arange(items)
            weights = popularity[pool] / popularity[pool].sum()
            rows_user.append(user)
            rows_item.append(rng.choice(pool, p=weights))
    pq.write_table(pa.table({"user_id": rows_user, "item_id": rows_item}), path)
