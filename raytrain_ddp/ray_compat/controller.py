"""Ray Train's controller and worker-group callbacks (a developer API, under `ray.train.v2._internal`):
what the service's `ControllerMarks` and `ClusterRecount` are made of. Where the capability
`controller_callbacks` is off, they derive from a plain class and the driver leaves them out of the
run (`callbacks`): the console then shows reports and failures only (Ray Train's public UserCallback),
not the worker group's phases, nodes, resizes and preemptions."""

from __future__ import annotations

from raytrain_ddp.ray_compat import enabled

# Imported whatever the switch says (the controller unpickles the callbacks under the driver's decision,
# `callbacks`, and may not see the driver's environment); only the driver decides whether they run.
try:
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
except ImportError:  # the public path: no such callbacks

    class ControllerCallback:  # type: ignore[no-redef]
        pass

    class WorkerGroupCallback:  # type: ignore[no-redef]
        pass


def callbacks(public: list, controller: list) -> list:
    """The run's callbacks: the public ones, and the controller's where they run."""
    return public + (controller if enabled("controller_callbacks") else [])


def placement_group_id(worker_group) -> str | None:
    """The hex id of a worker group's placement group (Ray Train's internal state), or None."""
    try:
        return worker_group.get_worker_group_state().placement_group_handle.placement_group.id.hex()
    except Exception:  # noqa: BLE001 - another Ray's internals: the driver then does without it
        return None
