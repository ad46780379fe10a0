"""Worker processes asked of a raylet ahead of the actors that will take them (`prestart`): Ray's own
API for this (`CoreWorker.PrestartWorkers`) has no Python binding, so the driver sends the raylet's
`PrestartWorkers` request itself, with the runtime environment written as Ray writes it (a raylet
matches an idle worker to an actor by a hash of that string). Also the names Ray gives the worker
setup hook's and the controller's environment variables. Off (`ray_compat.enabled`), nothing is asked
ahead and the workers carry no setup hook: Ray starts them as Ray Train asks for them."""

from __future__ import annotations

from raytrain_ddp.ray_compat import enabled

KEEP_ALIVE_S = 300  # how long the raylet keeps them for this job, unused, before its idle-worker rules apply


def available() -> bool:
    return enabled("prestart")


def hook_env() -> str:
    """The environment variable Ray's worker setup hook travels in (a runtime environment's
    `worker_process_setup_hook`, as Ray writes it)."""
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    return WORKER_PROCESS_SETUP_HOOK_ENV_VAR


def tasks_runtime_env() -> dict | None:
    """For the Ray tasks a worker starts (a streamed dataset's reads): they inherit the worker's runtime
    environment, and must not load a training worker's modules as they start."""
    return {"env_vars": {hook_env(): ""}} if available() else None


def propagated_env_keys() -> tuple[str, ...]:
    """The environment variables Ray Train's controller takes from the driver's environment at fit()."""
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    return tuple(ENV_VARS_TO_PROPAGATE)


def preload_train_worker() -> None:
    """Import Ray Train's worker actor's module (what a prestarted worker loads as it starts)."""
    import ray.train.v2._internal.execution.worker_group.worker  # noqa: F401


def prestart_workers(node: dict, job: str, serialized_env: str, count: int) -> None:
    """Ask `node`'s raylet for `count` worker processes of this job and runtime environment."""
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
