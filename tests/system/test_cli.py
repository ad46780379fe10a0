"""The command line as users run it: a fresh process, the job's embedded defaults, a clean directory.
(What the CLI refuses or prints without training is tests/unit/test_cli_args.py's.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from services import cli as raytrain_ddp
from services import free_port, user_env, wait_until

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.driver import timeline

CLI = str(Path(sys.executable).parent / "raytrain-ddp")
TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`make demo` minus the install: the flagship job on embedded defaults in an empty directory."""
    directory = tmp_path_factory.mktemp("demo")
    return directory, raytrain_ddp("train", "digits", cwd=directory)


def test_the_demo_trains_registers_and_prints_a_summary(demo):
    from mlflow.tracking import MlflowClient

    tmp_path, result = demo
    out = result.stdout

    assert result.returncode == 0, result.stderr[-3000:]
    assert [int(n) for n in re.findall(r"^epoch +(\d+)/3 ", out, re.M)] == [1, 2, 3]  # live progress
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

    # The run's timeline: every phase from the launch to the model registered, each once; the driver's
    # and the teardown's in their order (the controller's and rank 0's marks of a moment may cross).
    phases = [phase for phase, _, _ in json.loads((checkpoint.parent / "timeline.json").read_text())["phases"]]
    expected = [*timeline.DRIVER_START, *timeline.WORKER_START, timeline.FIRST_STEP, *timeline.TEARDOWN]
    assert sorted(phases) == sorted(expected)
    assert phases[: len(timeline.DRIVER_START)] == list(timeline.DRIVER_START)
    assert phases[-len(timeline.TEARDOWN) :] == list(timeline.TEARDOWN)


def test_one_driver_per_run_a_killed_driver_resumes_and_sigterm_stops_cleanly(tmp_path, record):
    """Driver A trains; B, the same command, is refused while A lives; A's whole process group is
    SIGKILLed; C, the same command again, resumes from A's latest checkpoint and is stopped with
    SIGTERM (`kill`, `ray job stop`, `scancel --batch --signal=TERM`), which stops it as Ctrl-C does
    (Ctrl-C itself: test_progress.py); D, the command C printed (the run made shorter), finishes the
    run and registers the model, once."""
    from mlflow.tracking import MlflowClient

    passes = tmp_path / "passes"  # tiny.py logs each training pass, per rank (no faults injected)
    passes.mkdir()
    command = [
        CLI,
        "train",
        TINY,
        "dataset.rows=2048",
        # A still trains when B, started at its epoch 2, is refused: 40 epochs of ~1 s each, where B's
        # refusal takes seconds. Each training pass waits 5 ms (128 a worker an epoch): a run watched
        # until it is stopped leaves the cores to the other test file rather than training on.
        "train.epochs=40",
        "run.name=shared",
        f"model.fault_log={passes}",
        "model.step_s=0.005",
    ]
    env = user_env()

    a = _leading_a_session(command, tmp_path, env)
    _read_until(a, rf"new run \(no checkpoint of a run shared in {re.escape(str(tmp_path))}/runs\)")
    _read_until(a, r"^epoch +2/40 ")

    started = time.monotonic()
    b = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    refused_in = time.monotonic() - started
    assert b.returncode == 2, b.stderr[-3000:]
    assert f"error: run shared is being trained by another driver (pid {a.pid} on " in b.stderr
    assert "wait for it to finish, or choose another run.name" in b.stderr
    lease = json.loads((tmp_path / "runs" / "shared" / "driver.json").read_text())
    assert lease["pid"] == a.pid  # B wrote nothing
    assert a.poll() is None  # and A trains on

    tree = psutil.Process(a.pid).children(recursive=True)  # A's local Ray: GCS, raylet, controller, workers
    assert not [p.name() for p in tree if p.name().startswith("ray-dashboard-")]  # a Ray of its own: no dashboard
    os.killpg(a.pid, signal.SIGKILL)
    a.wait(timeout=60)
    left = _still_running(tree, wait_s=30)
    assert not left, f"a killed driver must not leave its local Ray running: {left}"
    # Read only now that every process of A is gone: its controller and workers outlive the driver by a
    # moment and may still commit a checkpoint (seen in CI: twice, one epoch after the driver had gone).
    latest_of_a = _latest_checkpoint(tmp_path / "runs" / "shared")
    a_steps = len((passes / "rank0.log").read_text().split())

    c = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    resumed = _read_until(c, r"resuming from (epoch_\d{4}) \(epoch [\d.]+, step (\d+)\)")
    assert resumed.group(1) == latest_of_a.name  # the stale lease of the dead driver was taken over
    _read_until(c, r"^epoch +\d+/40 ")
    c_ray = psutil.Process(c.pid).children(recursive=True)  # its local Ray: GCS, raylet, monitor, workers
    c.send_signal(signal.SIGTERM)
    _, err = c.communicate(timeout=300)

    assert c.returncode == 143, err[-3000:]
    assert not _still_running(c_ray, wait_s=5), "the command stops the local Ray it started as it leaves"
    assert re.search(r"^interrupted: run shared was interrupted \(SIGTERM\)$", err, re.M), err[-3000:]
    continues = re.search(r"^checkpoints so far: \S+; the command below continues from (epoch_\S+) \(", err, re.M)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [stopped] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert stopped.info.status == "KILLED" and client.search_registered_models() == []
    resume = re.search(r"^resume: (.+)$", err, re.M).group(1)
    assert resume == shlex.join(
        [
            "raytrain-ddp",
            "train",
            TINY,
            "run.name=shared",
            f"model.fault_log={passes}",
            "model.step_s=0.005",
            "dataset.rows=2048",
            "train.epochs=40",
        ]
    )  # what differs from the job's YAML

    # D runs that command with the run shortened to two epochs past C's last checkpoint (train.epochs may
    # change on resume): what is tested is that it resumes, finishes and registers once, not 30-odd epochs.
    stop_at = int(ckpt.open_verified(_latest_checkpoint(tmp_path / "runs" / "shared")).metrics()["epoch"]) + 2
    d = raytrain_ddp(*shlex.split(resume)[1:], f"train.epochs={stop_at}", cwd=tmp_path)
    assert d.returncode == 0, d.stderr[-3000:]
    assert f"resuming from {continues.group(1)} " in d.stdout, (err[-2000:], d.stdout[-2000:])  # as C said
    assert re.search(rf"^epoch +{stop_at}/{stop_at} ", d.stdout, re.M), d.stdout[-3000:]
    [finished] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert finished.info.run_id == stopped.info.run_id and finished.info.status == "FINISHED"  # one MLflow run
    assert len(client.search_model_versions("name = 'tiny'")) == 1
    assert not (tmp_path / "runs" / "shared" / "driver.json").exists()  # let go at the end
    wasted = a_steps - int(resumed.group(2))
    assert 0 <= wasted <= 128  # at most the epoch A was in when it died
    record(
        "driver process group SIGKILLed, same command again (then Ctrl-C, then the printed command)",
        attempts="3 drivers",
        resumed=f"{resumed.group(1)} (step {resumed.group(2)})",
        wasted=wasted,
        checkpoints=len([p for p in (tmp_path / "runs" / "shared").iterdir() if p.is_dir()]),
        versions=1,
        note=f"second driver refused in {refused_in:.1f} s",
    )


def _leading_a_session(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """The command started in a session of its own (its process group signalled, its processes found
    by session), its output read as text."""
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _read_until(process: subprocess.Popen, pattern: str) -> re.Match:
    for line in process.stdout:
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"the driver ended before printing {pattern!r}: {process.stderr.read()[-3000:]}")


def _latest_checkpoint(run_dir: Path) -> Path:
    """What a resume uses: the newest checkpoint A's workers wrote whole (they may write one after the
    controller that would record it is gone), else Ray's record's latest."""
    import ray.train

    latest = Path(ray.train.Result.from_path(run_dir).checkpoint.path).name
    return run_dir / (ckpt.newest_unrecorded(str(run_dir), latest) or latest)


def _still_running(processes: list[psutil.Process], wait_s: float) -> list[str]:
    """The processes not yet gone after up to `wait_s` (a zombie is gone: it can no longer write)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for process in processes:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{process.pid} {process.name()}")
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A RAY_TMPDIR for the command: where a Ray it starts keeps its session (short: Ray's socket paths
    must fit in 107 bytes)."""
    directory = Path(tempfile.mkdtemp())
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_a_finished_run_run_again_says_so_at_once_without_starting_ray(demo, ray_tmp):
    """The demo's command again, naming its run: answered from the run's record, without Ray, with the
    command that trains it longer."""
    tmp_path, trained = demo
    assert trained.returncode == 0, trained.stderr[-3000:]
    name = re.search(r"run\.name=(digits-\S+)", trained.stdout).group(1)
    command = ["train", "digits", f"run.name={name}"]

    # From Python too: the same answer, as the run's summary, and no Ray started (in a process of its
    # own: this one may have a Ray already), side by side with the command (neither writes anything).
    script = f"""
import io, json, ray
from rich.console import Console
from raytrain_ddp import load_config, run
summary = run(load_config({command[1]!r}, overrides={command[2:]!r}), console=Console(file=io.StringIO()))
print(json.dumps([summary.already_finished, summary.attempts, summary.model.version, summary.best_checkpoint,
                  ray.is_initialized()]))
"""
    with subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as python:
        started = time.monotonic()
        again = raytrain_ddp(*command, cwd=tmp_path, env={"RAY_TMPDIR": str(ray_tmp)})
        took = time.monotonic() - started
        out, err = python.communicate(timeout=300)
    assert not (ray_tmp / "ray").exists()  # no Ray started, not even while the command loaded

    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{name} has already finished training (3 epochs) and its model is registered: nothing to do" in again.stdout
    assert f"To train it longer: raytrain-ddp train digits run.name={name} train.epochs=N with N > 3" in again.stdout
    assert re.search(r"registered model +digits-resnet18  version 1", again.stdout)
    assert again.stderr == ""
    assert took < 30  # was 76 s: Ray started, the workers trained nothing, registration found its version

    assert python.returncode == 0, err[-3000:]
    answer = json.loads(out.splitlines()[-1])
    assert answer == [True, 0, 1, str(re.search(r"best checkpoint +(\S+)", trained.stdout).group(1)), False]


def test_a_new_run_refused_once_its_ray_started_exits_in_seconds_leaving_no_process(tmp_path, ray_tmp):
    """A new run's Ray starts while the command loads torch (`session.start`); a check that comes
    after, here an MLflow server that does not answer, still refuses the run in seconds, and the Ray
    it started is stopped with it: no process of its session is left."""
    uri = f"http://127.0.0.1:{free_port()}"
    env = user_env({"RAY_TMPDIR": str(ray_tmp)})
    started = time.monotonic()
    command = _leading_a_session([CLI, "train", TINY, f"mlflow.tracking_uri={uri}"], tmp_path, env)
    _, err = command.communicate(timeout=120)
    took = time.monotonic() - started

    assert command.returncode == 2, err[-3000:]
    assert f"the MLflow tracking server {uri} is unreachable (connection refused)" in err
    assert "Traceback" not in err
    assert any((ray_tmp / "ray").glob("session_*"))  # its Ray had started
    # What this guards against is Ray's retries of a start (minutes); the bound leaves room for a host
    # whose two cores are busy with another test's cluster meanwhile.
    assert took < 90, took

    _wait_for_no_process_of(command.pid)


def test_ctrl_c_while_the_command_loads_stops_its_starting_ray_and_says_so(tmp_path, ray_tmp):
    """Ctrl-C while the command imports torch, its Ray starting beside it: exit 130 with a line, no
    traceback, nothing written and no process of its session left."""
    env = user_env({"RAY_TMPDIR": str(ray_tmp)})
    with _ctrl_c_as_in_a_terminal():
        command = _leading_a_session([CLI, "train", TINY], tmp_path, env)
    # Ray's session directory is made within a second of the start; the imports take longer
    wait_until(lambda: any((ray_tmp / "ray").glob("session_*")), 30, "the command's Ray starting")
    command.send_signal(signal.SIGINT)
    out, err = command.communicate(timeout=120)

    seen = f"{err[-3000:]}\nstdout: {out[-2000:]}\nwritten: {sorted(p.name for p in tmp_path.iterdir())}"
    assert command.returncode == 130, seen
    assert "interrupted (Ctrl-C) while loading, before anything was read or written" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    _wait_for_no_process_of(command.pid)


LEAVE_WHILE_A_THREAD_COLLECTS = """
import gc, os, sys, threading, time
import ray
from raytrain_ddp.cluster import session

ray.init(address=sys.argv[1], log_to_driver=False)
class Cycle:
    def __init__(self, ref):
        self.ref, self.me = ref, self
held = [Cycle(ray.put(i)) for i in range(2000)]  # cyclic garbage once dropped, each holding a Ray reference
def collect():  # a thread that allocates, as the model-logging rehearsal importing: the collector runs on it
    while held:
        held.pop()
        gc.collect()
        time.sleep(0.001)
threading.Thread(target=collect, daemon=True).start()
time.sleep(0.05)
session.leave()
time.sleep(0.5)  # and on, after Ray has gone
print(len(held), flush=True)
os._exit(3)
"""


def test_leaving_ray_while_another_thread_collects_garbage_keeps_the_commands_exit_status(ray_session):
    """A thread that frees a Ray object's reference while Ray shuts down made Ray's core worker end
    the driver with status 1: `raytrain-ddp train` exited 1 instead of 3 once, its registration
    refused, the model-logging rehearsal still importing beside the shutdown. `session.leave` lets
    the process end with its own status (and this script exits 1 without the freeze around Ray's
    shutdown: checked, 4 of 4)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, "-c", LEAVE_WHILE_A_THREAD_COLLECTS, address], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "core worker has already been shutdown" not in done.stderr
    assert 0 < int(done.stdout.split()[-1]) < 2000  # the thread collected throughout, and outlived the shutdown


EXAMPLE_ROWS_OF_A_LAZY_DATASET = """
import json, sys, threading
import ray
from raytrain_ddp.data import datasets as data
from raytrain_ddp.cluster import session
from raytrain_ddp.cluster.ray_address import RayAddress

session.connect(RayAddress(join=sys.argv[1]), False, lambda: None)
lazy = ray.data.range(64).map_batches(lambda batch: {"x": batch["id"] * 2})
rows = data.example_batch(lazy, 0)  # an execution, in the driver
print(json.dumps({"rows": rows["x"].tolist(), "threads": [t.name for t in threading.enumerate()]}))
"""


def test_a_drivers_dataset_executions_start_no_ray_data_usage_collection(ray_session):
    """Ray Data's usage collection is off in a driver that joined a cluster (a Ray that ray.init
    starts has Ray's usage stats off already, and with them Ray Data's): executing a dataset there (a
    lazy one's example rows) starts no thread polling the cluster's metrics (the same path creates
    the detached actor it feeds: one more process, 1.3 CPU-seconds beside the first step). Without
    `session`'s setting the thread runs: checked."""
    import ray

    shell = {k: v for k, v in user_env().items() if k != "RAY_USAGE_STATS_ENABLED"}  # set by this session's ray.init
    done = subprocess.run(
        [sys.executable, "-c", EXAMPLE_ROWS_OF_A_LAZY_DATASET, ray.get_runtime_context().gcs_address],
        env=shell,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["rows"] == [0, 2]
    assert "data-usage-metrics-poller" not in seen["threads"], seen["threads"]


@contextlib.contextmanager
def _ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """Children started meanwhile take SIGINT as a terminal's foreground command does. A test run
    started in the background of a script (`make test &`) ignores SIGINT, and so would its children:
    that command trained through the test's SIGINT and exited 0 (in three clean-clone runs of
    2026-11-27, started that way). What is ignored stays ignored across exec; a handler does not."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        signal.signal(signal.SIGINT, handler)


def _wait_for_no_process_of(session: int) -> None:
    """Until no process is left in the session a command led (its Ray's, started for it). Each has been
    asked to end as the command exits; on two cores busy with another test's run, some take over 10 s."""
    wait_until(lambda: not [p for p in psutil.process_iter() if _session_of(p) == session], 30, "its Ray ending")


def _session_of(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except (ProcessLookupError, PermissionError):
        return None
