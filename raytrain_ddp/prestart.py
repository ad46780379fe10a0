"""Ray Train's workers started ahead, their modules loaded while the driver still prepares the run.

A Ray Train worker is a new Python process that imports Ray, torch, Ray Train's worker and, as DDP
wraps the model, torch's compiler stack (`DistributedDataParallel.__init__` reads `torch._dynamo`'s
config): ~4 CPU-seconds each, all of it after the controller asks for the worker. Ray gives a new
actor an idle worker process of the same runtime environment if it has one; Ray Train's workers
carry one (the environment variables Ray Train passes on), so the ones Ray starts for a first driver
never serve them. The driver asks the local raylet for the run's worker processes with exactly that
runtime environment as soon as it has joined Ray (`start`), and each loads those modules as it
starts (`preload`, run by Ray as the workers' setup hook, `worker_runtime_env`): Ray Train's workers
are then these processes, their imports done while the driver built the datasets, checked the recipe
and started the controller (~1-2 s of a 2-core machine's start, bench/README.md).

Only where it is sure to pay: a cluster of one node (every worker lands on it), a driver without a
runtime environment of its own (`ray job submit --working-dir` gives one: Ray merges it into the
workers', and the match would need Ray's merge), and CPU workers (a GPU worker's devices are set as
its actor starts, after the hook). Processes the run does not take (it is refused after this point)
belong to the driver's job: Ray ends them with it, or hands them to its next run in the same process
(a notebook's). Ray's own API for this (`CoreWorker.PrestartWorkers`) has no Python binding in Ray
2.60, so the driver sends the raylet's `PrestartWorkers` request itself.
"""

from __future__ import annotations

import json
import os
import time

import ray
from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR as HOOK_ENV

from raytrain_ddp.config import Config

KEEP_ALIVE_S = 300  # how long the raylet keeps them for this job, unused, before its idle-worker rules apply
# Ray Train's controller sets it for itself (setdefault) and passes it on to each worker it starts.
_CONTROLLER_DEFAULTS = {"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}
# For the Ray tasks a worker starts (a streamed dataset's reads): they inherit the worker's runtime
# environment, and must not load a training worker's modules as they start.
TASKS_RUNTIME_ENV = {"env_vars": {HOOK_ENV: ""}}
# What this process asked for and no fit() has taken yet, by (Ray job, runtime environment): when.
_idle: dict[tuple[str, str], float] = {}


def preload() -> None:
    """A training worker's modules, loaded as its process starts. Never raises: Ray ends a worker whose
    setup hook fails, and the worker imports what failed here again, where the error is reported."""
    try:
        import ray.train.v2._internal.execution.worker_group.worker  # noqa: F401 - the worker actor's class
        import torch.distributed  # noqa: F401

        import raytrain_ddp.loop  # noqa: F401
    except BaseException:  # noqa: BLE001, S110 - an optimization only
        pass


def preload_ddp() -> None:
    """`preload`, and torch's compiler stack: DDP reads its config as it wraps the model."""
    preload()
    try:
        import torch._dynamo  # noqa: F401
    except BaseException:  # noqa: BLE001, S110
        pass


def threads_as_ray_says() -> None:
    """Torch's threads as Ray sets them for a worker's CPUs (OMP_NUM_THREADS, set as it starts the
    actor; 1 for half a CPU). A worker started ahead loaded torch before, and OpenMP took its count
    then, from the whole machine's cores: on 2 cores two such ranks ran 2 threads each, a CNN's
    epochs 2.5 times as long. The loop calls it first."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def worker_runtime_env(config: Config) -> dict:
    """What the run's workers carry beyond Ray Train's own environment: the preloading hook, on CPU."""
    if config.scaling.use_gpu:
        return {}
    hook = "preload_ddp" if config.scaling.max_workers > 1 or config.train.compile else "preload"
    return {"env_vars": {HOOK_ENV: f"{__name__}.{hook}"}}


def start(config: Config, fit_settings: dict[str, str]) -> int:
    """Ask the local raylet for the run's worker processes, loading their modules as they start;
    returns how many. 0 where it would not pay, or where the raylet did not take the request (the run
    goes on as it would have: its workers start when Ray Train asks for them)."""
    context = ray.get_runtime_context()
    if not config.run.prestart_workers or config.scaling.use_gpu or context.runtime_env:
        return 0
    alive = [node for node in ray.nodes() if node["Alive"]]
    if len(alive) != 1:
        return 0
    [node] = alive
    count = min(config.scaling.max_workers, _fit_on(node, config.scaling.resources_per_worker))
    if count < 1:
        return 0
    asked = (context.get_job_id(), _serialized(workers_env(config, fit_settings)))
    if asked in _idle and time.monotonic() - _idle[asked] < KEEP_ALIVE_S:
        return 0  # a run of this process refused after asking left them: this one takes those
    try:
        _prestart(node, *asked, count)
    except Exception:  # noqa: BLE001 - an optimization only
        return 0
    _idle[asked] = time.monotonic()
    return count


def taken() -> None:
    """fit() starts: Ray Train takes the processes asked for. (The raylet starts as many as it is asked
    for, whatever it has idle: without this record, each run of a process refused after asking, a
    notebook's say, would leave two more ~0.8 GB processes until their keep-alive ends.)"""
    _idle.clear()


def workers_env(config: Config, fit_settings: dict[str, str]) -> dict[str, str]:
    """The environment variables of the run's workers: those Ray Train's controller gets (the ones it
    propagates from the driver's environment as fit() starts, under `fit_settings`, and its own
    default), merged with the run's (`worker_runtime_env`)."""
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    driver = os.environ | fit_settings
    controller = _CONTROLLER_DEFAULTS | {key: driver[key] for key in ENV_VARS_TO_PROPAGATE if key in driver}
    return controller | worker_runtime_env(config)["env_vars"]


def _serialized(env_vars: dict[str, str]) -> str:
    """The workers' runtime environment as the raylet will see it from the controller: merged with the
    controller's by Ray's core worker, which writes it as nlohmann::json's dump() does (compact, keys
    sorted). The raylet matches an idle worker to an actor by a hash of this string."""
    return json.dumps({"env_vars": env_vars}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _prestart(node: dict, job: str, serialized_env: str, count: int) -> None:
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc
    from ray.core.generated.common_pb2 import Language

    request = node_manager_pb2.PrestartWorkersRequest(
        language=Language.PYTHON,
        job_id=bytes.fromhex(job),
        keep_alive_duration_secs=KEEP_ALIVE_S,
        num_workers=count,
    )
    request.runtime_env_info.serialized_runtime_env = serialized_env
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}", asynchronous=False)
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=5)
    finally:
        channel.close()


def _fit_on(node: dict, per_worker: dict[str, float]) -> int:
    """How many workers of `per_worker` resources the node holds."""
    resources = node["Resources"]
    return min((int(resources.get(key, 0) // amount) for key, amount in per_worker.items() if amount > 0), default=0)
