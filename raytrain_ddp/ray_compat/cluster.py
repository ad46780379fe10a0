"""What the service asks of Ray about its cluster where Ray has no public API: free resources per node,
the autoscaler's config, the runs Ray Train records, Ray's autoscaling coordinator, and the processes
of a local Ray this process started. Each answers as if the cluster had nothing to say (None, {}, [])
where its capability is off (`ray_compat.enabled`) or Ray's internals changed."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray

from raytrain_ddp.ray_compat import enabled

logger = logging.getLogger(__name__)


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """{node id: free resources}; {} where unknown (callers judge by the nodes' totals)."""
    if not enabled("cluster_state"):
        return {}
    try:
        from ray._private.state import state

        return state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - judge by the totals alone
        return {}


def autoscaler_config() -> Any:
    """The autoscaler's cluster config (node types, max counts), or None without an autoscaler (or
    where unknown). Ray Train reads the same record for its own, later, check."""
    if not enabled("cluster_state"):
        return None
    try:
        from ray._private.state import state

        return state.get_cluster_config()
    except Exception:  # noqa: BLE001 - no autoscaler: judge by the nodes there are
        return None


def train_runs() -> tuple[dict, dict] | None:
    """Ray Train's record of its runs and their attempts (what its dashboard shows), or None."""
    if not enabled("cluster_state"):
        return None
    try:
        from ray.train.v2._internal.state.state_actor import get_state_actor

        actor = get_state_actor()
        if actor is None:
            return None
        runs = ray.get(actor.get_train_runs.remote(), timeout=10)
        return runs, ray.get(actor.get_train_run_attempts.remote(), timeout=10)
    except Exception as e:  # noqa: BLE001 - the words are a help, never a reason to fail
        logger.debug("Ray Train's state actor did not answer: %s", e)
        return None


def _coordinator() -> Any:
    """Ray's autoscaling coordinator: Ray Train's and Ray Data's, created by whichever asks first."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    return get_or_create_autoscaling_coordinator()


def withdraw_request(requester: str) -> None:
    """Withdraw `requester`'s request for resources from the autoscaling coordinator (a killed
    controller cannot; it would hold its reservation until it expires, in 3 minutes)."""
    if not enabled("autoscaling_coordinator"):
        return
    try:
        ray.get(_coordinator().cancel_request.remote(requester_id=requester), timeout=10)
    except Exception as e:  # noqa: BLE001 - it expires by itself
        logger.warning("the run's resource request was not withdrawn (it expires within 3 min): %s", e)


def recounts() -> bool:
    """Whether an elastic run's controller can have the coordinator recount the nodes (`recount_nodes`)."""
    return enabled("elastic_recount")


def recount_nodes(requester: str) -> None:
    """Have the autoscaling coordinator count the alive nodes now (its tick), not within 20 s."""
    if not enabled("elastic_recount"):
        return
    try:
        ray.get(_coordinator().get_reserved_resources.remote(requester, recompute=True), timeout=5)
    except Exception as e:  # noqa: BLE001 - the coordinator's own tick counts them within 20 s
        logger.warning("the cluster's nodes not recounted for the elastic policy: %s", e)


def own_ray_options() -> dict[str, Any]:
    """ray.init's private settings for a local Ray this process starts: no idle workers started for
    the first driver (Ray Train's actors cannot use them), and an idle worker kept a minute, not a
    second (each epoch of a lazy dataset would start its tasks' processes anew)."""
    if not enabled("system_config"):
        return {}
    return {"_system_config": {"prestart_worker_first_driver": False, "idle_worker_killing_time_threshold_ms": 60_000}}


def own_node() -> Any:
    """The local Ray this process started (its processes), or None for a Ray it joined or where unknown."""
    if not enabled("own_raylet"):
        return None
    return getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)


def stop_monitor(node: Any) -> None:
    """Kill the autoscaler monitor of a local Ray at once: asked to stop, it reports its own death to
    the Ray going down around it, which took most of the second Ray's shutdown gives it."""
    if node is not None:
        with contextlib.suppress(Exception):
            node.kill_monitor(check_alive=False)


def raylet_pids(node: Any) -> list[int]:
    """The process ids of the raylets of a local Ray this process started."""
    if node is None:
        return []
    try:
        from ray._private import ray_constants

        return [p.process.pid for p in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])]
    except Exception:  # noqa: BLE001
        return []
