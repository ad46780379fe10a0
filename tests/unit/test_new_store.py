"""A run's first MLflow database is made while Ray starts (`sqlite_store.opening_store`, on a thread, under a
hidden name) and put in place only once the run is accepted (`tracking.start_run`): the same database
MLflow would have made, none left behind by a run refused before, none written over if another driver
made one meanwhile. It is a copy of an empty one of MLflow's schema, made once in the user's cache."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlflow.store.db.utils
import pytest
from mlflow.tracking import MlflowClient

from raytrain_ddp import load_config
from raytrain_ddp.registry import records, sqlite_store, tracking

TINY = Path(__file__).parents[1] / "jobs" / "tiny.py"


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """MLflow puts a new store's Default experiment under ./mlruns: here, not in the checkout."""
    monkeypatch.chdir(tmp_path)


def _config(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return load_config(str(TINY), overrides=[f"mlflow.tracking_uri={uri}", "mlflow.experiment=e", "run.name=r"])


def _files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name != "mlruns")


def test_a_new_database_is_made_aside_and_put_in_place_when_the_run_starts(tmp_path):
    config = _config(tmp_path)
    with sqlite_store.opening_store(config.mlflow.tracking_uri):
        pass
    [hidden] = _files(tmp_path)
    assert hidden.startswith(".mlflow.db.") and hidden.endswith(".new")  # made, not yet the store

    run_id = tracking.start_run(config, str(tmp_path / "runs" / "r"))

    assert _files(tmp_path) == ["mlflow.db"]
    client = MlflowClient(config.mlflow.tracking_uri)
    assert client.get_run(run_id).data.tags[records.RUN_NAME_TAG] == "r"
    (tmp_path / "direct").mkdir()
    direct = MlflowClient(f"sqlite:///{tmp_path / 'direct' / 'mlflow.db'}")  # as MLflow makes one itself
    assert client.get_experiment("0").artifact_location == direct.get_experiment("0").artifact_location


def test_a_run_refused_while_the_store_opens_leaves_no_database(tmp_path):
    config = _config(tmp_path)
    with pytest.raises(RuntimeError, match="refused"), sqlite_store.opening_store(config.mlflow.tracking_uri):
        raise RuntimeError("refused")
    assert _files(tmp_path) == []


def test_a_database_another_driver_made_meanwhile_is_kept(tmp_path):
    config = _config(tmp_path)
    with sqlite_store.opening_store(config.mlflow.tracking_uri):
        pass
    theirs = MlflowClient(config.mlflow.tracking_uri)
    their_experiment = theirs.create_experiment("theirs")

    tracking.start_run(config, str(tmp_path / "runs" / "r"))

    assert _files(tmp_path) == ["mlflow.db"]
    assert theirs.get_experiment_by_name("theirs").experiment_id == their_experiment


def test_a_process_that_ends_before_its_run_starts_leaves_no_database(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = f"""
import json, os
from raytrain_ddp.registry import tracking
from raytrain_ddp.registry import records
from raytrain_ddp.registry import sqlite_store
with sqlite_store.opening_store({uri!r}):
    pass
print(json.dumps(os.listdir({str(tmp_path)!r})))
"""
    ended = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0, ended.stderr[-3000:]
    [made] = json.loads(ended.stdout.splitlines()[-1])  # what was there before the process ended
    assert made.startswith(".mlflow.db.")
    assert _files(tmp_path) == []


def test_a_new_experiments_artifacts_go_beside_the_database_not_under_the_working_directory(tmp_path, monkeypatch):
    """MLflow puts a sqlite store's new experiment under the process's ./mlruns; under `ray job submit`
    that is the job's copy of the working directory, which Ray deletes with the job (and the registered
    models' files with it). The service puts it beside the database, as MLflow lays it out there."""
    (tmp_path / "store").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    config = load_config(str(TINY), overrides=[f"mlflow.tracking_uri={uri}", "mlflow.experiment=e", "run.name=r"])

    run_id = tracking.start_run(config, str(tmp_path / "runs" / "r"))

    experiment = MlflowClient(uri).get_experiment_by_name("e")
    beside = tmp_path / "store" / "mlruns" / experiment.experiment_id
    assert experiment.artifact_location == str(beside)
    assert (beside / run_id / "artifacts" / "config.yaml").is_file()
    assert not (tmp_path / "elsewhere" / "mlruns" / experiment.experiment_id).exists()
    assert tracking.start_run(config, str(tmp_path / "runs" / "r")) == run_id  # found again, as before


def _schema(database: Path) -> list[tuple]:
    """Each table and index, its definition's lines sorted (MLflow's own migrations order a table's
    constraints differently from one database to the next), and the schema's revision."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        revision = db.execute("SELECT version_num FROM alembic_version").fetchall()
    return [
        (kind, name, sorted(line.strip(" ,") for line in (sql or "").splitlines())) for kind, name, sql in rows
    ] + revision


@pytest.fixture(scope="module")
def mlflows_own(tmp_path_factory) -> list[tuple]:
    """The schema of a store MLflow makes itself."""
    direct = tmp_path_factory.mktemp("direct") / "mlflow.db"
    MlflowClient(f"sqlite:///{direct}").search_experiments()
    return _schema(direct)


def _made_store(directory: Path) -> MlflowClient:
    """A run's new store in `directory`, as the driver makes it (opened aside, put in place)."""
    directory.mkdir()
    config = _config(directory)
    with sqlite_store.opening_store(config.mlflow.tracking_uri):
        pass
    tracking.start_run(config, str(directory / "runs" / "r"))
    return MlflowClient(config.mlflow.tracking_uri)


def test_mlflow_makes_its_schema_once_and_each_new_store_is_a_copy_of_it(tmp_path, monkeypatch, mlflows_own):
    """MLflow's migrations run for the first new store only; every store is MLflow's own schema, with
    its own Default experiment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    made = []
    initialize = mlflow.store.db.utils._initialize_tables
    monkeypatch.setattr(mlflow.store.db.utils, "_initialize_tables", lambda engine: made.append(initialize(engine)))

    first, second = _made_store(tmp_path / "first"), _made_store(tmp_path / "second")

    assert len(made) == 1
    [cached] = (tmp_path / "cache" / "raytrain_ddp").iterdir()
    for store in ("first", "second"):
        assert _schema(tmp_path / store / "mlflow.db") == mlflows_own, store
    assert _schema(cached) == mlflows_own
    for client in (first, second):
        assert [e.name for e in client.search_experiments()] == ["e", "Default"]
    assert first.get_experiment("0").artifact_location == str(tmp_path / "mlruns" / "0")


def test_a_cached_schema_of_another_mlflow_is_made_again(tmp_path, monkeypatch, mlflows_own):
    """A cached schema MLflow does not open (an older revision, as another MLflow of the same version
    number would leave) is replaced, and the store is still MLflow's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _made_store(tmp_path / "first")
    [cached] = (tmp_path / "cache" / "raytrain_ddp").iterdir()
    with contextlib.closing(sqlite3.connect(cached)) as db, db:
        db.execute("UPDATE alembic_version SET version_num = '451aebb31d03'")  # MLflow 1.0's

    client = _made_store(tmp_path / "second")

    assert client.get_experiment_by_name("e") is not None
    assert _schema(tmp_path / "second" / "mlflow.db") == mlflows_own
    assert not cached.exists()  # made again by the next new store
    _made_store(tmp_path / "third")
    assert _schema(cached) == mlflows_own


def test_without_a_cache_mlflow_makes_the_store_itself(tmp_path, monkeypatch):
    """Where the cache cannot be written, the store is still made aside, by MLflow's migrations."""
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-directory"))
    config = _config(tmp_path)

    with sqlite_store.opening_store(config.mlflow.tracking_uri):
        pass

    [hidden] = set(_files(tmp_path)) - {"not-a-directory"}
    assert hidden.startswith(".mlflow.db.") and hidden.endswith(".new")
    tracking.start_run(config, str(tmp_path / "runs" / "r"))
    assert MlflowClient(config.mlflow.tracking_uri).get_experiment_by_name("e") is not None


def test_mlflow_comes_in_on_the_stores_thread_not_with_the_drivers_modules(tmp_path):
    """The command imports the driver's modules before Ray starts; mlflow (1.5 s of imports on 2 cores)
    is left to opening_store's thread, which runs while Ray starts, for a new store or an existing one;
    its loggers stay as quiet as the command set them before the import."""
    MlflowClient(f"sqlite:///{tmp_path / 'existing.db'}").search_experiments()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_LOGGING_LEVEL"}
    runs = {}
    for name in ("new.db", "existing.db"):  # side by side: each process imports mlflow
        script = f"""
import json, sys
import logging
import raytrain_ddp.cli, raytrain_ddp.driver.run
from raytrain_ddp.cluster import session
from raytrain_ddp.registry import tracking
from raytrain_ddp.registry import records
from raytrain_ddp.registry import sqlite_store
before = "mlflow" in sys.modules
session.quiet_logs(verbose=False)  # as prepare.make does, before the store's thread starts
with sqlite_store.opening_store("sqlite:///{tmp_path / name}"):
    pass
quiet = all(logging.getLogger(n).getEffectiveLevel() >= logging.ERROR for n in ("mlflow", "alembic"))
print(json.dumps([before, "mlflow.tracking" in sys.modules, quiet]))
"""
        runs[name] = subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1]) == [False, True, True], name  # loaded, and quiet
        assert err == "", name  # no migration lines (a new store) on the console
