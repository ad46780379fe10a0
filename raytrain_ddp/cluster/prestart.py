"""Ray Train's processes started ahead: the workers', their modules loaded, and the controller's, while
the driver still prepares the run.

A Ray Train worker is a new Python process that imports Ray, torch, Ray Train's worker and, as DDP
wraps the model, torch's compiler stack (`DistributedDataParallel.__init__` reads `torch._dynamo`'s
config): seconds of CPU each, all of it after the controller asks for the worker. Ray Train's
controller is a new process too, started as fit() begins. Ray gives a new actor an idle worker
process of the same runtime environment if it has one; Ray Train's controller and workers carry one
(the environment variables Ray Train passes on), so the processes Ray starts for a first driver never
serve them. The driver asks the raylets for the run's processes with exactly those runtime
environments: the workers' as soon as it has joined Ray (`start`), each loading their modules as it
starts (`worker.setup.preload`, run by Ray as the workers' setup hook, `worker_runtime_env`); the controller's
(and its synchronization actor's) once the datasets are built (`start_controller`). Ray Train's
controller and workers are then these processes, started while the driver built the datasets and
checked the recipe (docs/ray-versions.md: what it buys).

The workers only where it is sure to pay: where Ray has no choice of their nodes (one node has room
for them, or the nodes' rooms add up to exactly the run's workers, as a cluster sized for the run:
`capacity.placement`), each node asked for its share, and CPU workers (a GPU worker's devices are set
as its actor starts, after the hook); the controller always lands on the driver's node. Where the
driver has a runtime environment of its own (`ray job submit --working-dir` gives one), Ray merges it
into every actor's, and the processes asked for carry that merge.
Processes the run does not take (it is refused after this point) belong to the driver's job: Ray ends
them with it, or hands them to its next run in the same process (a notebook's). Ray's own API for this
(`CoreWorker.PrestartWorkers`) has no Python binding in Ray 2.60, so the driver sends the raylet's
`PrestartWorkers` request itself.
"""

from __future__ import annotations

import json
import os
import time

import ray

from raytrain_ddp.cluster import capacity, session
from raytrain_ddp.config.schema import Config
from raytrain_ddp.ray_compat import prestart as ray_compat
from raytrain_ddp.worker import setup

KEEP_ALIVE_S = ray_compat.KEEP_ALIVE_S
# In the controller's runtime environment unless the driver's sets it (setdefault), so in the workers'.
_CONTROLLER_DEFAULTS = {"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}
# What this process asked for and no fit() has taken yet, by (Ray job, runtime environment, node): when.
_idle: dict[tuple[str, str, str], float] = {}


def worker_runtime_env(config: Config) -> dict:
    """What the run's workers carry beyond Ray Train's own environment: the preloading hook, on CPU."""
    if config.scaling.use_gpu or not ray_compat.available():
        return {}
    hook = "preload_ddp" if config.scaling.max_workers > 1 or config.train.compile else "preload"
    return {"env_vars": {ray_compat.hook_env(): f"{setup.__name__}.{hook}"}}


def ahead(config: Config) -> None:
    """What the run starts ahead once the driver has joined Ray (`session.connect`; the command's
    `session.start`, on its thread, while the command still imports torch and Ray Train): the workers'
    processes (`start`). Not Ray's autoscaling coordinator, which the controller waits for on a
    cluster's first run: created ahead it competed with this start on a Ray of its own, where every
    run is the first, and bought less than half a second elsewhere (docs/ray-versions.md)."""
    start(config)


def start(config: Config) -> int:
    """Ask the raylets of the nodes the run's workers will be on for their processes, loading their
    modules as they start; returns how many. 0 where it would not pay, or where the raylets did not
    take the request (the run goes on as it would have: its workers start when Ray Train asks for
    them)."""
    alive = [node for node in ray.nodes() if node["Alive"]]
    if config.scaling.use_gpu or _here(config, alive) is None:
        return 0
    raylets = {node["NodeID"]: node for node in alive}
    env = _as_the_controller_sends({"env_vars": controller_env(config) | worker_runtime_env(config)["env_vars"]})
    return sum(_ask(raylets[node], env, count) for node, count in capacity.placement(config).items() if node in raylets)


def start_controller(config: Config) -> int:
    """Ask the local raylet for two processes of Ray Train's controller's runtime environment: the
    controller's, and its synchronization actor's (which inherits that environment); both are placed
    on the driver's node, here, whatever the cluster. Returns 2, or 0 as `start` does. Asked once the
    workers' processes have started (after the datasets are built): a raylet starts at most as many
    processes at once as its node has CPUs and drops the rest of a request (on 2 CPUs, the controller's
    asked first left one worker to start when Ray Train asked for it)."""
    here = _here(config, [node for node in ray.nodes() if node["Alive"]])
    if here is None:
        return 0
    return _ask(here, _as_the_driver_sends({"env_vars": controller_env(config)}), 2)


def taken() -> None:
    """fit() starts: Ray Train takes the processes asked for. (The raylet starts as many as it is asked
    for, whatever it has idle: without this record, each run of a process refused after asking, a
    notebook's say, would leave two more ~0.8 GB processes until their keep-alive ends.)"""
    _idle.clear()


def controller_env(config: Config) -> dict[str, str]:
    """The environment variables of Ray Train's controller, its runtime environment: those it
    propagates from the driver's environment as fit() starts (with the run's settings in it,
    `session.fit_environment`), and its default."""
    driver = os.environ | session.fit_environment(config.run.controller_poll_s, config.scaling.elastic)
    return _CONTROLLER_DEFAULTS | {key: driver[key] for key in ray_compat.propagated_env_keys() if key in driver}


def _as_the_driver_sends(runtime_env: dict) -> str:
    """The runtime environment of an actor the driver creates, as the raylet sees it (it matches an idle
    worker to an actor by a hash of this string). Where the driver has none of its own, as Ray's Python
    API writes it (`RuntimeEnv.serialize`: json.dumps, keys sorted); else merged into the driver's by
    Ray's core worker, as `_as_an_actor_sends`."""
    job = _job_runtime_env()
    return _as_an_actor_sends(_merged(job, runtime_env)) if job else json.dumps(runtime_env, sort_keys=True)


def _as_the_controller_sends(runtime_env: dict) -> str:
    """The runtime environment of an actor the controller creates (the controller has one: its
    environment variables, merged into the driver's), as the raylet sees it."""
    return _as_an_actor_sends(_merged(_job_runtime_env(), runtime_env))


def _as_an_actor_sends(runtime_env: dict) -> str:
    """A runtime environment merged by Ray's core worker into its creator's, written as nlohmann::json's
    dump() does (compact, keys sorted, UTF-8)."""
    return json.dumps(runtime_env, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _job_runtime_env() -> dict:
    """The driver's runtime environment, its job's ({} without one)."""
    return json.loads(ray.get_runtime_context().get_runtime_env_string() or "{}")


def _merged(parent: dict, child: dict) -> dict:
    """`child` merged into `parent` as Ray's core worker does (`OverrideRuntimeEnv`): the child's keys
    win, and the environment variables of both are kept, the child's winning."""
    merged = parent | child
    if "env_vars" in parent and "env_vars" in child:
        merged["env_vars"] = parent["env_vars"] | child["env_vars"]
    return merged


def _here(config: Config, alive: list[dict]) -> dict | None:
    """The driver's node, where the run's processes may be started ahead, if the run allows it."""
    if not config.run.prestart_workers or not ray_compat.available():
        return None
    node = ray.get_runtime_context().get_node_id()
    return next((n for n in alive if n["NodeID"] == node), None)


def _ask(node: dict, serialized_env: str, count: int) -> int:
    """Ask `node`'s raylet for `count` processes of this runtime environment, unless this process did
    and no fit() has taken them yet; returns how many it asked for."""
    job = ray.get_runtime_context().get_job_id()
    key = (job, serialized_env, node["NodeID"])
    if key in _idle and time.monotonic() - _idle[key] < KEEP_ALIVE_S:
        return 0  # a run of this process refused after asking left them: this one takes those
    try:
        ray_compat.prestart_workers(node, job, serialized_env, count)
    except Exception:  # noqa: BLE001 - an optimization only
        return 0
    _idle[key] = time.monotonic()
    return count
