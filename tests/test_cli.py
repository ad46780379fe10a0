"""The command line as users run it: a fresh process, the job's embedded defaults, a clean directory."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CLI = str(Path(sys.executable).parent / "raytrain-ddp")


def raytrain_ddp(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return subprocess.run([CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_config_fails_before_anything_is_created(tmp_path):
    result = raytrain_ddp("train", "digits", "train.epochs=-1", "model.num_clases=3", cwd=tmp_path)

    assert result.returncode == 2
    assert "invalid configuration for job 'digits' (2 problem(s))" in result.stderr
    assert "train.epochs: Input should be greater than or equal to 1 (got -1, from command line)" in result.stderr
    assert "model.num_clases: unknown key" in result.stderr and "did you mean 'num_classes'?" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no MLflow store


def test_jobs_lists_the_flagship(tmp_path):
    result = raytrain_ddp("jobs", cwd=tmp_path)
    assert result.returncode == 0 and "digits" in result.stdout.split()


@pytest.mark.slow
def test_the_demo_trains_registers_and_prints_a_summary(tmp_path):
    """`make demo` minus the install: the flagship job on embedded defaults in an empty directory."""
    from mlflow.tracking import MlflowClient

    result = raytrain_ddp("train", "digits", cwd=tmp_path)
    out = result.stdout

    assert result.returncode == 0, result.stderr[-3000:]
    assert [int(n) for n in re.findall(r"^epoch +(\d+)/6 ", out, re.M)] == [1, 2, 3, 4, 5, 6]  # live progress
    accuracy = float(re.search(r"val_accuracy \(global\) +([\d.]+)", out).group(1))
    assert accuracy >= 0.95
    assert re.search(r"validation samples +360 ", out)
    checkpoint = Path(re.search(r"best checkpoint +(\S+)", out).group(1))
    assert checkpoint.parent.parent == tmp_path / "runs" and (checkpoint / "manifest.json").is_file()
    assert "model URI              models:/digits-resnet18/1" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in out
    assert result.stderr == ""  # progress and a summary, not a wall of Ray log lines or warnings
    assert "train longer           raytrain-ddp train digits run.name=digits-" in out

    [version] = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_model_versions("name = 'digits-resnet18'")
    assert int(version.version) == 1


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_the_printed_command_resumes_it(tmp_path):
    from mlflow.tracking import MlflowClient

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    process = subprocess.Popen(
        [CLI, "train", "digits", "train.epochs=4", "train.lr=0.003", "run.name=stopped"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    for line in process.stdout:  # wait until training is under way
        if line.startswith("epoch   1/4"):
            break
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)

    assert process.returncode == 130, err[-3000:]
    assert re.search(r"^interrupted: run stopped was interrupted \((Ctrl-C|stopped after epoch [123] of 4)\)$", err, re.M)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [stopped] = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert stopped.info.status == "KILLED"
    assert client.search_registered_models() == []
    assert (tmp_path / "runs" / "stopped" / "epoch_0001" / "manifest.json").is_file()  # the work so far is kept

    resume = re.search(r"^resume: (.+)$", err, re.M).group(1)
    assert resume == "raytrain-ddp train digits run.name=stopped train.epochs=4 train.lr=0.003"  # differs from YAML
    resumed = raytrain_ddp(*shlex.split(resume)[1:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resuming after epoch [123],", resumed.stdout)
    [finished] = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert finished.info.run_id == stopped.info.run_id and finished.info.status == "FINISHED"
    assert len(client.search_model_versions("name = 'digits-resnet18'")) == 1
