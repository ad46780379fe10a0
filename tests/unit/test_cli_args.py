"""What the command line refuses or prints without training: `raytrain_ddp.cli.main` in this process,
in a clean working directory, as `raytrain-ddp ARGS` runs it. (Training from the command line, in a
fresh process, is tests/system/test_cli.py's.)"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from raytrain_ddp.cli import main


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def raytrain_ddp(capsys, monkeypatch):
    def run(*args: str, cwd) -> Result:
        monkeypatch.chdir(cwd)
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's refusals
            code = e.code
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def test_bad_config_fails_before_anything_is_created(raytrain_ddp, tmp_path):
    result = raytrain_ddp("train", "digits", "train.epochs=-1", "model.num_clases=3", cwd=tmp_path)

    assert result.returncode == 2
    assert "invalid configuration for job 'digits' (2 problem(s))" in result.stderr
    assert "train.epochs: Input should be greater than or equal to 1 (got -1, from command line)" in result.stderr
    assert "model.num_clases: unknown key" in result.stderr and "did you mean 'num_classes'?" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no MLflow store


def test_overrides_may_follow_an_option(raytrain_ddp, tmp_path):
    """`train JOB --config FILE key=value`: argparse alone would reject the override after the option."""
    layer = tmp_path / "layer.yaml"
    layer.write_text("train:\n  lr: 0.005\n")
    result = raytrain_ddp("train", "digits", "--config", str(layer), "train.epochs=7", "--print-config", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert "  epochs: 7\n" in result.stdout and "  lr: 0.005\n" in result.stdout
    refused = raytrain_ddp("train", "digits", "train.epochs=7", "--nonsense", cwd=tmp_path)
    assert refused.returncode == 2 and "unrecognized arguments: --nonsense" in refused.stderr


def test_jobs_lists_the_flagship(raytrain_ddp, tmp_path):
    result = raytrain_ddp("jobs", cwd=tmp_path)
    assert result.returncode == 0 and "digits" in result.stdout.split()


def test_promote_refuses_an_unknown_model_or_version_and_moves_the_champion(raytrain_ddp, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from raytrain_ddp.registry import model_registry, records

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    nowhere = raytrain_ddp("promote", "m", "1", cwd=tmp_path)  # the default store, ./mlflow.db: none here
    assert nowhere.returncode == 2 and "no registered model 'm' in sqlite:///" in nowhere.stderr
    assert list(tmp_path.iterdir()) == []  # not created

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_registered_model("m")
    for value in ("0.9", "0.95"):
        score = {
            records.SCORE_ATTRIBUTE_TAG: "val_accuracy",
            records.SCORE_ORDER_TAG: "max",
            records.SCORE_TAG: value,
        }
        client.create_model_version("m", source=str(tmp_path), tags=score)
    model_registry.converge_champion(client, "m")
    assert int(client.get_model_version_by_alias("m", "champion").version) == 2

    unknown = raytrain_ddp("promote", "other", "1", "--tracking-uri", uri, cwd=tmp_path)
    assert unknown.returncode == 2 and f"error: no registered model 'other' in {uri}" in unknown.stderr
    missing = raytrain_ddp("promote", "m", "3", "--tracking-uri", uri, cwd=tmp_path)
    assert missing.returncode == 2 and "error: model 'm' has no version 3 (its versions: 1, 2)" in missing.stderr
    assert raytrain_ddp("promote", "m", "two", "--tracking-uri", uri, cwd=tmp_path).returncode == 2

    moved = raytrain_ddp("promote", "m", "1", "--tracking-uri", uri, cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout == "m: champion moved from version 2 to version 1\n"
    assert int(client.get_model_version_by_alias("m", "champion").version) == 1
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the default, as for every command
    again = raytrain_ddp("promote", "m", "1", cwd=tmp_path)
    assert again.returncode == 0 and "champion stays version 1" in again.stdout


def test_ctrl_c_while_a_recipe_imports_says_so_without_a_traceback(tmp_path):
    """The command as a fresh process: Ctrl-C as the recipe imports its libraries (raised by the recipe
    here, at the moment a real one would be importing torch) ends it with 130 and one line."""
    recipe = tmp_path / "slow_to_import.py"
    recipe.write_text("raise KeyboardInterrupt  # as a Ctrl-C would, while this imports torch\n")
    command = [sys.executable, "-m", "raytrain_ddp.cli", "train", str(recipe)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr == "interrupted (Ctrl-C)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow_to_import.py"]


@pytest.mark.parametrize("uri", [False, True], ids=["local path", "URI"])
def test_a_run_a_live_driver_holds_is_refused_at_once_writing_nothing(raytrain_ddp, tmp_path, uri):
    """On local storage or behind a URI (file:// here, as s3:// goes): the lease is read as it is named,
    before Ray starts (nothing but the run's directory in the working directory, no MLflow store)."""
    from test_lease import _write_holder

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_holder(tmp_path / "runs" / "held", pid=sleeper.pid)
        storage = f"file://{tmp_path}/runs" if uri else str(tmp_path / "runs")
        result = raytrain_ddp("train", "digits", f"run.storage_path={storage}", "run.name=held", cwd=tmp_path)
    finally:
        sleeper.kill()

    assert result.returncode == 2, result.stderr
    assert f"error: run held is being trained by another driver (pid {sleeper.pid} on " in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    assert [p.name for p in (tmp_path / "runs" / "held").iterdir()] == ["driver.json"]
