"""`raytrain-ddp sweep` as users run it: a fresh process, a local Ray of its own, the tiny recipe.

One sweep, shared by the checks: 4 trials over a grid of learning rates, 1 worker x 0.5 CPU each, 2 at a
time, 4 epochs; the worst learning rates start last, so ASHA (grace 1 epoch, halving) stops them once
the others have set the bar. Its driver is SIGKILLed (its own Ray with it) as soon as a trial has
finished, then the same command resumes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from services import BIN, user_env, wait_until

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")
LRS = (0.1, 0.03, 0.0001, 0.00003)  # in Tune's order: the good ones set the bar for the others
EPOCHS = 4


def _command(root: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "raytrain-ddp"),
        "sweep",
        TINY,
        f"--search=train.lr=grid({','.join(map(str, LRS))})",
        "--concurrent=2",
        f"train.epochs={EPOCHS}",
        "scaling.num_workers=1",
        "run.name=lr",
        "run.controller_poll_s=0.2",
        f"run.storage_path={root / 'runs'}",
        f"mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}",
        "mlflow.register=always",
        *extra,
    ]


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.parent.name for p in run.glob("*/manifest.json"))


def _epochs(run: Path) -> list[float]:
    return [json.loads((run / c / "metrics.json").read_text())["epoch"] for c in _checkpoints(run)]


def _finished(root: Path) -> list[Path]:
    return [t for t in sorted((root / "runs").glob("lr-t*")) if EPOCHS in _epochs(t)]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The sweep killed once a trial has finished, then resumed to its end: what each step left."""
    root = tmp_path_factory.mktemp("sweep")
    first = subprocess.Popen(
        _command(root),
        cwd=root,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_until(lambda: _finished(root) or first.poll() is not None, 600, "a trial finished", every_s=0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the driver and its own Ray: nothing ends cleanly
            os.killpg(first.pid, signal.SIGKILL)
    first_out = first.communicate()[0]
    assert first.returncode == -signal.SIGKILL, first_out[-3000:]
    before = {t.name: _checkpoints(t) for t in _finished(root)}
    started = time.monotonic()
    second = subprocess.run(_command(root), cwd=root, env=user_env(), capture_output=True, text=True, timeout=900)
    return root, before, second, time.monotonic() - started


def test_a_resumed_sweep_trains_no_finished_trial_again_stops_the_trailing_and_registers_the_best(swept):
    from mlflow.tracking import MlflowClient

    root, before, result, _ = swept
    out = result.stdout
    assert result.returncode == 0, (out + result.stderr)[-4000:]
    assert before, "no trial had finished when the driver was killed"
    runs = {t.name: t for t in sorted((root / "runs").glob("lr-t*"))}
    assert len(runs) == 4

    # Finished before the kill: not trained again (no checkpoint it did not have), answered from its record.
    # (Killed as its last checkpoint landed, Ray's record of it may come only now, and with it the pruning
    # of the oldest beyond checkpoint.num_to_keep.)
    for name, checkpoints in before.items():
        after = _checkpoints(runs[name])
        assert set(after) <= set(checkpoints) and max(after) == max(checkpoints), (name, checkpoints, after)

    # The scheduler stopped at least one trial early: recorded as stopped, its checkpoints kept.
    stopped = [t for t in runs.values() if (t / "stopped_by_sweep.json").is_file()]
    assert stopped, out
    for trial in stopped:
        assert max(_epochs(trial)) < EPOCHS and _checkpoints(trial), trial.name
    finished = [t for t in runs.values() if t not in stopped]
    assert all(max(_epochs(t)) == EPOCHS for t in finished)
    assert re.search(rf"4 trials \({len(finished)} finished, {len(stopped)} stopped\)", out), out

    # One MLflow run per trial, nested under the sweep's; stopped ones say so.
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "tiny"]
    all_runs = client.search_runs([experiment.experiment_id])
    [parent] = [r for r in all_runs if r.info.run_name == "lr"]
    trials = [r for r in all_runs if r.info.run_name != "lr"]
    assert sorted(r.info.run_name for r in trials) == sorted(runs)
    for r in trials:
        assert r.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert r.data.params["train.lr"] in {str(lr) for lr in LRS}
    assert {r.info.run_name for r in trials if r.data.tags["sweep.status"] == "stopped"} == {t.name for t in stopped}
    assert "scores.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]

    # The best trial's model registered once; it loads and gives its reported score.
    best = parent.data.tags["sweep.best_trial"]
    best_score = parent.data.metrics["best_val_mse"]
    [version] = client.search_model_versions("name = 'tiny'")
    assert client.get_run(version.run_id).info.run_name == best
    assert re.search(rf"best: {best} \(train\.lr=[\d.e-]+\): val_mse {best_score:.4g}", out), out
    assert best_score == min(
        json.loads((runs[best] / c / "metrics.json").read_text())["val_mse"] for c in _checkpoints(runs[best])
    )
    assert abs(_val_mse(f"models:/tiny/{version.version}", root) - best_score) <= 1e-5 * max(1.0, best_score)


def _val_mse(model_uri: str, root: Path) -> float:
    """The registered model's mean squared error over the tiny recipe's validation rows."""
    import importlib.util

    import mlflow
    import numpy as np

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    spec = importlib.util.spec_from_file_location("tiny_recipe", TINY)
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    rows = tiny.build_datasets(seed=0, source="torch")["val"]
    predicted = mlflow.pyfunc.load_model(model_uri).predict(rows.x.numpy())
    return float(np.mean((np.asarray(predicted).reshape(-1) - rows.y.numpy()) ** 2))


def test_the_same_command_again_answers_from_the_records(swept):
    """A sweep run to its end, run again: nothing trains, nothing registers twice."""
    root, _, _, _ = swept
    again = subprocess.run(_command(root), cwd=root, env=user_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    from mlflow.tracking import MlflowClient

    assert len(MlflowClient(f"sqlite:///{root / 'mlflow.db'}").search_model_versions("name = 'tiny'")) == 1

    # Another search under the same name would go on with the trials Tune drew: refused, before Ray starts.
    changed = [c if not c.startswith("--search=") else "--search=train.lr=grid(0.1,0.5)" for c in _command(root)]
    refused = subprocess.run(changed, cwd=root, env=user_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "sweep lr was started with sweep.search.train.lr=" in refused.stderr, refused.stderr


def test_bad_spaces_and_keys_are_refused_before_ray_starts_every_problem_at_once(tmp_path):
    searched = [
        "train.lrr=loguniform(1e-4,1e-1)",  # no such key
        "train.lr=loguniform(0,1)",  # no log of 0
        "train.momentum=normal(0,1)",  # no such space
        "train.epochs=choice(1,0)",  # a value the run refuses
        "run.name=choice(a,b)",  # the sweep's own
        "train.weight_decay=grid(0.1,0.01)",  # 2 combinations for 3 trials
    ]
    result = _refused(tmp_path, *(f"--search={s}" for s in searched), "--trials=3")
    for said in (
        "train.lrr: unknown key .* did you mean 'lr'",
        "loguniform needs a low bound above 0",
        "train.momentum='normal\\(0,1\\)': not a search space; write one of choice",
        r"train\.epochs=choice\(1, 0\): train\.epochs.*greater than or equal to 1",
        "run.name is the sweep's own, not a trial's",
        "set sweep.trials to a multiple of 2",
    ):
        assert re.search(said, result.stderr), (said, result.stderr)
    assert "(6 problem(s))" in result.stderr
    assert re.search(r"sweep\.trials: how many trials", _refused(tmp_path, "--search=train.lr=uniform(0.1,0.2)").stderr)


def _refused(root: Path, *args: str) -> subprocess.CompletedProcess:
    command = [str(BIN / "raytrain-ddp"), "sweep", TINY, *args, f"run.storage_path={root / 'runs'}"]
    result = subprocess.run(command, cwd=root, env=user_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert not (root / "runs").exists() and not (root / "mlflow.db").exists()
    return result


def test_more_concurrent_trials_than_the_machine_holds_are_refused_before_ray_starts(tmp_path):
    cores = os.cpu_count() or 1
    command = [
        str(BIN / "raytrain-ddp"), "sweep", TINY, "--search=train.lr=choice(0.1,0.01)", f"--trials={cores + 1}",
        f"--concurrent={cores + 1}", "scaling.num_workers=1", "scaling.resources_per_worker={CPU: 1}",
        f"run.storage_path={tmp_path / 'runs'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    said = f"sweep.concurrent={cores + 1}: {cores + 1} trials × (1 workers × CPU 1 + 0.01 for the trial) need CPU "
    assert said in result.stderr, result.stderr
    assert "ray" not in " ".join(p.name for p in (tmp_path).iterdir()).lower()
