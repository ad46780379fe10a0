"""The checkpoint format: a save -> load round trip restores everything, and a damaged one is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import ray.train
import torch

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config.schema import TrainSettings
from raytrain_ddp.worker.optim import Accumulation, Updater
from raytrain_ddp.worker.step import forward_backward, optimizer_step

# fp16 turns the grad scaler on, so its state is part of the round trip (CPU scaler: test only; the
# service allows fp16 on GPUs).
TRAIN = TrainSettings(lr=0.1, lr_schedule="cosine", warmup_steps=2, epochs=2, precision="fp16")


def _parts(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    return model, Updater(model, TRAIN, steps_per_epoch=3, device=torch.device("cpu"))


def _trained_parts():
    model, updater = _parts(seed=0)
    squared = lambda model, x: model(x).pow(2).mean()  # noqa: E731
    for i in range(3):
        forward_backward(model, squared, torch.randn(16, 4), updater, Accumulation(micro_batches=3, per_step=1), i)
        optimizer_step(updater, TRAIN.grad_clip_norm)
    return model, updater


@pytest.fixture
def saved(tmp_path):
    model, updater = _trained_parts()
    state = ckpt.TrainingState(2, 3, updater.state_dict(), [ckpt.rng_state()] * 2)
    ckpt.save(
        tmp_path, model=model, state=state, config={"job": "x", "train": {"epochs": 4}}, metrics={"val_loss": 0.5}
    )
    return tmp_path, model, updater


def test_round_trip_restores_weights_optimizer_schedule_scaler_counters_config_and_metrics(saved):
    directory, model, updater = saved
    fresh_model, fresh_updater = _parts(seed=1)

    saved = ckpt.open_verified(directory)
    fresh_model.load_state_dict(saved.model_state())
    state = saved.training_state()
    fresh_updater.load_state_dict(state.updater)

    torch.testing.assert_close(fresh_model.state_dict(), model.state_dict())  # BatchNorm buffers included
    optimizer_state = fresh_updater.optimizer.state_dict()["state"]
    torch.testing.assert_close(optimizer_state, updater.optimizer.state_dict()["state"])
    assert fresh_updater.lr == updater.lr
    assert fresh_updater.scaler.state_dict() == updater.scaler.state_dict() and updater.scaler.get_scale() > 0
    assert (state.epoch, state.step, len(state.rng)) == (2, 3, 2)
    assert saved.config() == {"job": "x", "train": {"epochs": 4}}
    assert saved.metrics() == {"val_loss": 0.5}


def test_every_file_loads_without_unpickling_objects(saved):
    directory = saved[0]
    for name in (ckpt.MODEL_FILE, ckpt.STATE_FILE):
        torch.load(directory / name, weights_only=True)  # raises on anything but tensors and primitives


def test_rng_state_round_trip_reproduces_every_generator():
    state = ckpt.rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    ckpt.set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2]
    torch.testing.assert_close(first[2], again[2])


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (
            lambda d: (d / ckpt.MODEL_FILE).write_bytes((d / ckpt.MODEL_FILE).read_bytes()[:-10]),
            "model.pt is truncated",
        ),
        (lambda d: _flip_a_byte(d / ckpt.STATE_FILE), "train_state.pt does not match its checksum"),
        (lambda d: (d / ckpt.CONFIG_FILE).unlink(), "config.json is missing"),
        (lambda d: (d / ckpt.MANIFEST_FILE).unlink(), "never completed"),
        (lambda d: (d / ckpt.MANIFEST_FILE).write_text("{"), "unreadable"),
    ],
    ids=["truncated", "flipped-byte", "missing-file", "no-manifest", "bad-manifest"],
)
def test_a_damaged_checkpoint_is_refused(saved, damage, says):
    directory = saved[0]
    damage(directory)
    with pytest.raises(ckpt.CheckpointError, match=says):
        ckpt.open_verified(directory)


def test_manifest_lists_every_file_with_its_checksum(saved):
    manifest = json.loads((saved[0] / ckpt.MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {ckpt.MODEL_FILE, ckpt.STATE_FILE, ckpt.CONFIG_FILE, ckpt.METRICS_FILE}
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in manifest["files"].values())


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _run_of_three(tmp_path):
    """Three checkpoints of one run, at steps 4, 6 and 8, as Ray lists them: best first, not newest."""
    model, updater = _trained_parts()
    reported = []
    for step, epoch, batches in ((4, 0, 4), (6, 1, 0), (8, 1, 2)):
        directory = tmp_path / ckpt.dir_name(epoch, step, batches)
        directory.mkdir()
        state = ckpt.TrainingState(epoch, step, updater.state_dict(), [ckpt.rng_state()], batches)
        ckpt.save(directory, model=model, state=state, config={}, metrics={"step": step})
        reported.append((ray.train.Checkpoint.from_directory(str(directory)), {"step": step}))
    return [reported[1], reported[2], reported[0]]


def test_checkpoint_names_say_where_training_stood():
    assert ckpt.dir_name(3, 450, 0) == "epoch_0003"
    assert ckpt.dir_name(3, 470, 20) == "epoch_0004-step_0000470"


def test_the_newest_checkpoint_that_verifies_is_opened_and_the_damaged_ones_are_named(tmp_path):
    newest_first = ckpt.newest_first(_run_of_three(tmp_path))
    assert [Path(c.path).name for c in newest_first] == [
        "epoch_0002-step_0000008",
        "epoch_0001",
        "epoch_0001-step_0000004",
    ]
    (tmp_path / "epoch_0002-step_0000008" / ckpt.MANIFEST_FILE).unlink()

    with ckpt.open_first_verified(newest_first) as opened:
        assert opened.name == "epoch_0001" and opened.verified.training_state().step == 6
        assert [str(s) for s in opened.skipped] == [
            "epoch_0002-step_0000008: no manifest.json: the checkpoint was never completed"
        ]


def test_a_checkpoint_written_but_not_recorded_by_ray_is_where_the_run_resumes(tmp_path):
    """Rank 0's report returns once its checkpoint is whole on storage; a worker that dies before Ray's
    controller records it leaves it there, unrecorded: the run resumes from it, not from Ray's latest.
    One that is not whole (no manifest: its upload was cut) is passed over, without being called damaged."""
    run = _run_of_three(tmp_path)  # as if Ray had recorded only the first two, by step: 4 and 6
    recorded = [(c, m) for c, m in run if m["step"] < 8]
    latest = ckpt.newest_first(recorded)[0]
    (tmp_path / "epoch_0003").mkdir()  # an upload cut short, newer still
    (tmp_path / "errors").mkdir()  # not a checkpoint

    unrecorded = ckpt.unrecorded(str(tmp_path), Path(latest.path).name)
    assert [Path(c.path).name for c in unrecorded] == ["epoch_0003", "epoch_0002-step_0000008"]
    with ckpt.open_resume_point(latest, recorded, unrecorded) as opened:
        assert opened.name == "epoch_0002-step_0000008" and not opened.recorded and opened.skipped == []
        assert opened.verified.training_state().step == 8
    assert ckpt.newest_unrecorded(str(tmp_path), Path(latest.path).name) == "epoch_0002-step_0000008"

    (tmp_path / "epoch_0002-step_0000008" / ckpt.MANIFEST_FILE).unlink()  # none whole: Ray's latest
    with ckpt.open_resume_point(latest, recorded, ckpt.unrecorded(str(tmp_path), "epoch_0001")) as opened:
        assert opened.name == "epoch_0001" and opened.recorded
    cut = tmp_path / "cut"  # a run whose first upload was cut short: nothing recorded, nothing whole
    (cut / "epoch_0001").mkdir(parents=True)
    with ckpt.open_resume_point(None, [], ckpt.unrecorded(str(cut), None)) as opened:
        assert opened is None  # a new run
    assert ckpt.position("epoch_0004") > ckpt.position("epoch_0004-step_0000450") > ckpt.position("epoch_0003")


def test_a_run_whose_every_checkpoint_is_damaged_names_each_and_why(tmp_path):
    checkpoints = ckpt.newest_first(_run_of_three(tmp_path))
    for checkpoint in checkpoints:
        _flip_a_byte(Path(checkpoint.path) / ckpt.MODEL_FILE)
    with pytest.raises(ckpt.NoValidCheckpoint) as none:
        with ckpt.open_first_verified(checkpoints):
            pass
    assert str(none.value).count("model.pt does not match its checksum") == 3


def test_a_model_with_frozen_parameters_checkpoints_only_what_trains_and_loads_back_onto_its_base():
    """LoRA's case: a frozen base rebuilt by build_model, small trained parts saved and loaded."""

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(0)  # the base: the same every time, like pretrained weights
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 2))
        model[0].requires_grad_(False)
        model[1].requires_grad_(False)
        torch.manual_seed(seed)  # the trained part: different on each build
        torch.nn.init.normal_(model[2].weight)
        return model

    trained = build(seed=1)
    weights = ckpt.model_weights(trained)
    assert sorted(weights) == ["2.bias", "2.weight"]

    fresh = build(seed=2)
    ckpt.load_weights(fresh, weights)
    torch.testing.assert_close(fresh.state_dict(), trained.state_dict())

    with pytest.raises(ckpt.CheckpointError, match=r"missing \['2.weight'\]"):
        ckpt.load_weights(build(seed=2), {"2.bias": weights["2.bias"]})
    with pytest.raises(ckpt.CheckpointError, match=r"unexpected \['3.weight'\]"):
        ckpt.load_weights(build(seed=2), {**weights, "3.weight": torch.zeros(1)})


def test_equal_scores_rank_the_later_checkpoint_best_as_ray_keeps_it(tmp_path):
    """Ray Train's checkpoint manager itself (no Ray started): three checkpoints with one val_loss and
    num_to_keep=2. Ray deletes the first and ranks the last best; `best_first` agrees, and so does
    `rank`, which the console's ★ best uses."""
    import asyncio

    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    async def fit() -> None:  # the manager notifies its listeners on the running event loop
        manager = CheckpointManager(
            CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min"),
            StorageContext(storage_path=str(tmp_path), experiment_dir_name="run"),
        )
        for step in (10, 20, 30):
            directory = tmp_path / "run" / f"step_{step}"
            directory.mkdir(parents=True)
            report = _TrainingReport(ray.train.Checkpoint(str(directory)), {"val_loss": 0.5, "step": step}, False)
            manager.register_checkpoint(report)

    asyncio.run(fit())
    record = ray.train.Result.from_path(str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run").glob("step_*")) == ["step_20", "step_30"]  # the first deleted
    ranked = ckpt.best_first(record.best_checkpoints, "val_loss", "min")
    assert [Path(checkpoint.path).name for checkpoint, _ in ranked] == ["step_30", "step_20"]
    assert ckpt.rank({"val_loss": 0.5, "step": 30}, "val_loss", "min") > ckpt.rank(
        {"val_loss": 0.5, "step": 20}, "val_loss", "min"
    )


def test_a_run_that_ended_as_its_last_checkpoint_landed_ranks_it_with_those_ray_recorded(tmp_path):
    """A run stopped as its last checkpoint landed (a sweep's driver killed then, in CI) has that
    checkpoint whole and Ray's record without it, and nothing trains again to report it: the run is
    finished. Its best, which registration and a sweep rank, is ranked over that checkpoint too, with
    the metrics it holds; one never whole is not a checkpoint."""
    import asyncio

    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    from raytrain_ddp import load_config
    from raytrain_ddp.driver import plan

    model, updater = _trained_parts()
    run = tmp_path / "run"

    def save(epoch: int, val_mse: float) -> tuple[Path, dict]:
        directory, metrics = (
            run / ckpt.dir_name(epoch, 8 * epoch, 0),
            {"epoch": epoch, "step": 8 * epoch, "val_mse": val_mse},
        )
        directory.mkdir(parents=True)
        state = ckpt.TrainingState(epoch, 8 * epoch, updater.state_dict(), [ckpt.rng_state()], 0)
        ckpt.save(directory, model=model, state=state, config={}, metrics=metrics)
        return directory, metrics

    async def recorded() -> None:  # Ray Train's own checkpoint manager records epochs 1 and 2 (no Ray started)
        manager = CheckpointManager(
            CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val_mse", checkpoint_score_order="min"),
            StorageContext(storage_path=str(tmp_path), experiment_dir_name="run"),
        )
        for epoch, val_mse in ((1, 0.5), (2, 0.4)):
            directory, metrics = save(epoch, val_mse)
            manager.register_checkpoint(_TrainingReport(ray.train.Checkpoint(str(directory)), metrics, False))

    asyncio.run(recorded())
    save(3, 0.3)  # whole, never recorded
    (run / "epoch_0004").mkdir()  # an upload cut short
    record = ckpt.run_record(str(run))
    assert sorted(Path(c.path).name for c, _ in record.best_checkpoints) == ["epoch_0001", "epoch_0002"]

    ranked = ckpt.best_first(ckpt.reported(str(run), record), "val_mse", "min")
    assert [(Path(c.path).name, m["val_mse"]) for c, m in ranked] == [
        ("epoch_0003", 0.3),
        ("epoch_0002", 0.4),
        ("epoch_0001", 0.5),
    ]
    tiny = load_config(str(Path(__file__).parents[1] / "jobs" / "tiny.py"), overrides=["train.epochs=3"])
    standing = plan.resume_point(str(run), tiny)
    assert (standing.checkpoint, standing.best["val_mse"]) == ("epoch_0003", 0.3)


@pytest.mark.parametrize(
    ("order", "scores", "best"),
    [
        ("min", [0.3, 0.1, 0.2, 0.1], 3),  # the later of two equal bests
        ("max", [0.3, 0.9, 0.9, 0.2], 2),
        ("max", [float("nan"), 0.1, float("-inf")], 1),  # NaN ranks last, below -inf (as in Ray)
        ("min", [0.2, float("nan")], 0),
    ],
)
def test_best_first_ranks_by_score_then_by_step(order, scores, best):
    reported = [(f"checkpoint {i}", {"val_x": s, "step": 10 * (i + 1)}) for i, s in enumerate(scores)]
    ranked = ckpt.best_first(reported, "val_x", order)
    assert ranked[0] == reported[best]
    assert sorted(ranked, key=lambda cm: cm[1]["step"]) == reported  # nothing lost or duplicated


def test_a_checkpoint_trained_again_at_the_same_step_and_score_ranks_by_ray_order():
    """A step retrained after a damaged checkpoint (`epoch_0003-retrained`): Ray lists it later, so better."""
    reported = [("epoch_0003", {"val_x": 0.5, "step": 18}), ("epoch_0003-retrained", {"val_x": 0.5, "step": 18})]
    assert [name for name, _ in ckpt.best_first(reported, "val_x", "min")] == ["epoch_0003-retrained", "epoch_0003"]


def test_a_run_on_another_number_of_workers_passes_over_their_mid_epoch_checkpoints(tmp_path):
    """Checkpoints written by 2 workers, mid-epoch 1 (step 4), epoch 1's end (6), mid-epoch 2 (8): on 1
    worker the mid-epoch ones, positions in the 2 workers' data, are passed over for epoch 1's end.
    With only mid-epoch 1 left, an elastic run (`start_over`) trains from the start, passing it over
    too; any other run is refused, naming it."""
    model, updater = _trained_parts()
    run = []
    for step, epoch, batches in ((4, 0, 4), (6, 1, 0), (8, 1, 2)):
        directory = tmp_path / ckpt.dir_name(epoch, step, batches)
        directory.mkdir()
        state = ckpt.TrainingState(epoch, step, updater.state_dict(), [ckpt.rng_state()] * 2, batches)
        ckpt.save(directory, model=model, state=state, config={}, metrics={"step": step, "workers": 2})
        run.append((ray.train.Checkpoint.from_directory(str(directory)), {"step": step}))
    latest = run[-1][0]

    with ckpt.open_resume_point(latest, run, (), world_size=2) as opened:
        assert opened.name == "epoch_0002-step_0000008" and opened.skipped == []
    with ckpt.open_resume_point(latest, run, (), world_size=1) as opened:
        assert opened.name == "epoch_0001"
        assert [str(s) for s in opened.skipped] == [
            "epoch_0002-step_0000008: mid-epoch, a position in the data of 2 workers, not 1"
        ]

    first = run[0][0]
    with ckpt.open_resume_point(first, run[:1], (), world_size=1, start_over=True) as opened:
        assert opened.checkpoint is None and [s.name for s in opened.skipped] == ["epoch_0001-step_0000004"]
    with pytest.raises(ckpt.NoValidCheckpoint, match="resumable on 1 workers"):
        with ckpt.open_resume_point(first, run[:1], (), world_size=1):
            pass
