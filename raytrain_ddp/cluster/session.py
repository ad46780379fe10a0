"""The Ray session a command runs in, and the environment it sets up for Ray and MLflow.

Which Ray: the one this process already `ray.init()`-ed (a notebook's), else the cluster RAY_ADDRESS
names (as `ray job submit` sets it, checked by `ray_address.py` before Ray starts), else a new local one.
The command starts (or joins) it on a thread while it imports torch and Ray Train (`start`), and
`connect` takes it up; a notebook's `run()` starts it in `connect`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import psutil
import ray

from raytrain_ddp.cluster.ray_address import ADDRESS_ENV, RayAddress, check_environment
from raytrain_ddp.ray_compat import cluster as ray_compat

# Ray Train reads its controller's poll interval from the driver's environment when fit() starts.
CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
# On by default: a watcher actor per run that restarts the workers in time when a node is drained.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Off by default: Ray Train's record of its runs (a detached state actor), which the dashboard shows.
STATE_TRACKING_ENV = "RAY_TRAIN_ENABLE_STATE_TRACKING"
PLACEMENT_WAIT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # the placement group's wait (Ray: 60 s)
# A healthy placement takes well under a second; an elastic run never waits for a node to come (it
# starts on those alive, then grows), only for Ray's count of the cluster to catch up.
ELASTIC_PLACEMENT_WAIT_S = 15
MLFLOW_LOG_LEVEL_ENV = "MLFLOW_LOGGING_LEVEL"  # read by mlflow as it is imported
# How many times ray.init tries to reach a cluster's GCS, about a second apart (ray/_private/node.py).
GCS_ATTEMPTS_ENV = "RAY_gcs_server_port_wait_time_s"
# A Ray of its own (it ends with the command) starts without the dashboard: its nine module processes
# cost a small machine seconds of the start, and each wakes the cores a hundred times a second while the
# ranks train. For the dashboard: `ray start --head`, then RAY_ADDRESS=auto. Nor does it start idle
# workers for its first driver: Ray Train's actors cannot use them (they carry a runtime environment),
# and a Ray Data task starts one when it needs it. And a worker
# process left idle is kept for a minute, not Ray's second: where a node runs more processes than it has
# CPUs (Ray Train's actors alone outnumber a small node's CPUs), Ray ends the idle ones past that second,
# so each epoch of a lazy Ray Dataset would start its Ray Data tasks' processes anew (several times the
# epoch's own time for a small dataset). Both are ray_compat's `system_config`.
OWN_RAY = {"include_dashboard": False, **ray_compat.own_ray_options()}
# Ray Data's usage collection (new in Ray 2.60), on in a driver that joins a cluster unless Ray's usage
# stats are off there (a Ray that ray.init starts turns them off in the process): each process that
# executes a dataset starts a thread polling the cluster's metrics, and the first creates a detached
# actor, one more process started beside the run's first step. It feeds
# only Ray's usage report; Ray's own usage stats setting is left as it is.
DATA_USAGE_OFF_ENV = "RAY_DATA_USAGE_DISABLED"
# MLflow's HTTP client retries a failed call for about four minutes by default; a tracking server that
# is down should cost seconds and a clear message instead. Where the environment sets them, it wins.
BOUNDED_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


interrupted_by: str | None = None  # "SIGTERM" once the command was told to stop (stop_on_sigterm)
_sigterm_stops = False
_started: Future | None = None  # Ray, started or joined by `start` on a thread, until `connect` takes it up


def stop_on_sigterm() -> None:
    """From now on a SIGTERM (`kill`, `scancel --batch --signal=TERM`, `ray job stop`) stops the run as
    Ctrl-C does: the workers stopped, the MLflow run marked KILLED, the lease let go, the resume
    command printed. (`connect` puts it back after ray.init, whose own handler aborts the process.)"""
    global _sigterm_stops
    _sigterm_stops = True
    signal.signal(signal.SIGTERM, _stop)


def _stop(signum: int, frame: object) -> None:
    """Ctrl-C's handler, called here: Ray Train's while fit() runs (it stops the workers), else Python's
    (KeyboardInterrupt). Called, not signalled: `ray job stop` starts drivers with SIGINT blocked, and
    a shell's background job ignores it. The first SIGTERM only: a second one, as Slurm signals
    every process of a job, changes nothing."""
    global interrupted_by
    if interrupted_by is not None:
        return
    interrupted_by = signal.Signals(signum).name
    ctrl_c = signal.getsignal(signal.SIGINT)
    if not callable(ctrl_c):  # SIG_IGN or SIG_DFL
        raise KeyboardInterrupt
    ctrl_c(signal.SIGINT, frame)


def ray_address() -> RayAddress:
    """RAY_ADDRESS, checked (`ray_address.check_environment`); nothing to join if this process has a Ray."""
    return RayAddress() if ray.is_initialized() and _started is None else check_environment()


def start(address: RayAddress, verbose: bool, joined: Callable[[], None]) -> None:
    """Start the local Ray (or join `address`) on a thread while the command goes on, then call
    `joined` there: importing torch and Ray Train keeps one core busy for ~2 s, and Ray's processes
    (the run's own among them, `joined` asks for them) start on the other meanwhile. `connect` takes
    it up. Only for a run that will train: one answered from its record needs no Ray."""
    global _started
    _started = Future()
    threading.Thread(
        target=_start_and_stay, args=(_started, address, verbose, joined), name="ray-start", daemon=True
    ).start()


def _start_and_stay(started: Future, address: RayAddress, verbose: bool, joined: Callable[[], None]) -> None:
    try:
        with _quiet_about_the_thread():
            _init(address, verbose)
        joined()
    except BaseException as e:  # noqa: BLE001 - for `connect` to raise, in the command's thread
        started.set_exception(e)
        return
    started.set_result(None)
    # A local Ray's processes are started to die with the thread that started them (PR_SET_PDEATHSIG
    # is per thread): this one stays for as long as the process.
    threading.Event().wait()


@contextlib.contextmanager
def _quiet_about_the_thread() -> Iterator[None]:
    """ray.init off the main thread warns that it leaves SIGTERM's handler alone: the command sets its
    own (`stop_on_sigterm`), as it would after ray.init on the main thread."""
    logger = logging.getLogger("ray._private.worker")

    def not_the_warning(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")

    logger.addFilter(not_the_warning)
    try:
        yield
    finally:
        logger.removeFilter(not_the_warning)


def connect(address: RayAddress, verbose: bool, joined: Callable[[], None]) -> None:
    """Join `address` (checked by `ray_address`), else start a local Ray, unless this process has one;
    then call `joined` (or, where `start` began it, wait for it and its `joined`). A cluster that
    accepts the connection but does not answer like a Ray GCS raises ConnectionError."""
    global _started
    os.environ.setdefault(DATA_USAGE_OFF_ENV, "1")  # for this process's executions; the environment's wins
    if _started is not None:
        started, _started = _started, None
        started.result()  # `joined` called, on its thread
    else:
        if not ray.is_initialized():
            _init(address, verbose)
            if _sigterm_stops:
                signal.signal(signal.SIGTERM, _stop)
        joined()
    from ray.data import DataContext  # not before `start`: a new local Ray starts while the command imports it

    context = DataContext.get_current()
    # A recipe's datasets in the same row order every time: without it, a materialized map_batches
    # lists its blocks in the order its tasks finished, and the data order would not be a function
    # of the seed (exact resume and reproducible runs depend on it).
    context.execution_options.preserve_order = True
    context.enable_progress_bars = verbose
    context.print_on_execution_start = verbose


def _init(address: RayAddress, verbose: bool) -> None:
    logging_level = logging.INFO if verbose else logging.ERROR
    # RAY_ADDRESS wins over ray.init's argument: set it to what was checked while Ray starts. Ray
    # tries a GCS for ~40 s, 20 times over (13 minutes, for a port that answers but is no GCS):
    # once is enough for a cluster that runs (the environment may say otherwise).
    joined = {ADDRESS_ENV: address.join, GCS_ATTEMPTS_ENV: os.environ.get(GCS_ATTEMPTS_ENV, "1")}
    with environment(joined if address.join else {}):
        for attempt in range(1, OWN_RAY_ATTEMPTS + 1):
            before = _own_processes()
            try:
                ray.init(log_to_driver=verbose, logging_level=logging_level, **({} if address.join else OWN_RAY))
                return
            except Exception as e:
                if address.join or attempt == OWN_RAY_ATTEMPTS or STARTUP_TIMED_OUT not in str(e):
                    raise
                _end(_own_processes() - before)  # what the attempt started: its GCS, raylet, ...


# Ray gives a new local node 30 s to be registered by its GCS (ray/_private/node.py; not a setting): on a
# machine whose cores are busy (another Ray starting, a training run) that can pass, and ray.init gives up.
# A local Ray of its own is started once more, after the processes of the attempt are ended.
STARTUP_TIMED_OUT = "timed out during startup"
OWN_RAY_ATTEMPTS = 2


def _own_processes() -> set[psutil.Process]:
    try:
        return set(psutil.Process().children(recursive=True))
    except psutil.Error:
        return set()


def _end(processes: set[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(list(processes), timeout=10)


def leave() -> None:
    """Leave Ray, stopping the local one this process started. Its autoscaler monitor is killed first,
    at once: asked to stop, it first reports its own death to the Ray going down around it, and that
    used up most of the second Ray's shutdown gives each process. It holds nothing that its end could
    lose.

    Nothing is garbage-collected while Ray shuts down: a cycle freed then that holds a reference to a
    Ray object makes Ray's core worker end the process with status 1 ("The core worker has already
    been shutdown"; a driver exited 1 instead of 3 once). The collector runs on whichever thread allocates,
    such as the model-logging rehearsal still importing when a registration failed at once, and
    gc.disable() would not stop a thread calling gc.collect(); frozen, what exists now is collected
    after Ray has gone, where freeing a reference does nothing."""
    global _started
    if _started is not None:  # stopped before `connect` took it up (Ctrl-C, a refusal): wait, then stop it
        started, _started = _started, None
        with contextlib.suppress(BaseException):
            started.result()
    node = ray_compat.own_node()  # this process's Ray: its processes, if it started them
    ray_compat.stop_monitor(node)
    workers = _workers_started_by(node)
    gc.freeze()
    try:
        ray.shutdown()
    finally:
        gc.unfreeze()
    for worker in workers:  # one still starting when its raylet went keeps trying to reach it
        with contextlib.suppress(psutil.Error):
            worker.kill()


def _workers_started_by(node: Any) -> list[psutil.Process]:
    """The worker processes of the raylet this process started (none for a Ray it joined). Ray's
    shutdown leaves them to end as they find their raylet gone; one still starting then (asked for
    ahead, `prestart`, by a command stopped while it loads) outlived the command by more than 10 s
    once, on a busy machine."""
    try:
        return [child for pid in ray_compat.raylet_pids(node) for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def quiet_logs(verbose: bool) -> None:
    """Ray Data's, MLflow's and its migrations' INFO lines on the console only `verbose`. mlflow sets
    its loggers' levels as it is imported, from MLFLOW_LOGGING_LEVEL (INFO by default), and it is
    imported later (tracking.py: on a thread while Ray starts): the variable says the same, unless the
    environment sets it."""
    level = logging.INFO if verbose else logging.ERROR
    for noisy in ("ray.data", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(level)
    if "mlflow" not in sys.modules:
        os.environ.setdefault(MLFLOW_LOG_LEVEL_ENV, logging.getLevelName(level))


def fit_environment(controller_poll_s: float, elastic: bool) -> dict[str, str]:
    """What Ray Train reads from the driver's environment when fit() starts (and passes to its
    controller and workers): the controller's poll interval, and
    - for an elastic run, a short wait for the workers' placement group (ELASTIC_PLACEMENT_WAIT_S):
      Ray Train sizes it from what it last saw of the cluster, and after a node's loss that is the
      lost node too; only once the wait ends does it ask again for as many workers as fit (Ray's
      60 s wait made a shrink take a minute);
    - on a cluster of one machine with no autoscaler, no preemption watcher: no other node can be
      drained there, and the watcher is one more process to start (a second of CPU on a small
      machine) before the first step;
    - on a cluster of several machines or with an autoscaler, Ray Train's record of its runs (its
      state actor, which the dashboard shows): a run whose workers wait for resources names the runs
      that hold them from it (capacity.holders).
    The user's own setting of any of them wins."""
    values = {CONTROLLER_POLL_ENV: str(controller_poll_s)}
    if elastic:
        values[PLACEMENT_WAIT_ENV] = os.environ.get(PLACEMENT_WAIT_ENV, str(ELASTIC_PLACEMENT_WAIT_S))
    alive = [node for node in ray.nodes() if node["Alive"]]
    if len(alive) == 1 and autoscaler_config() is None:
        values[PREEMPTION_WATCHER_ENV] = os.environ.get(PREEMPTION_WATCHER_ENV, "0")
    else:
        values[STATE_TRACKING_ENV] = os.environ.get(STATE_TRACKING_ENV, "1")
    return values


def autoscaler_config():
    """The autoscaler's cluster config (node types, max counts), or None without an autoscaler."""
    return ray_compat.autoscaler_config()


def bounded_mlflow_retries() -> contextlib.AbstractContextManager:
    """MLflow's HTTP retries bounded (BOUNDED_RETRIES), unless the environment sets them."""
    return environment({key: os.environ.get(key, value) for key, value in BOUNDED_RETRIES.items()})


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the call, then put back the caller's (a notebook's, say)."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
