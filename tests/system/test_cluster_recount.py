"""An elastic run's recount of the cluster (`callbacks.ClusterRecount`), on a real local Ray with Ray's
own autoscaling coordinator and Ray Train's own controller states: a recount is the coordinator's tick
(which counts the alive nodes) done at once, and it comes where Ray Train is about to size the workers
from that count: as the controller starts, on a restart or a reschedule (not on every state update),
and just before each resize check, scaling.resize_check_s apart from the worker group's start. (The
elastic run on a cluster that gains and loses a node is test_node_loss.py's.)

What shows a tick from outside the coordinator: a resource request that has expired keeps its
reservation until the coordinator's next tick purges it (Ray's own tick: every 20 s from the
coordinator's start, which an earlier test of the session may have made at any time: the test restarts
it first, so that its own tick is 20 s away and the probes, under a second in all, see only the
recount's)."""

from __future__ import annotations

import itertools
import os
import time

import ray
from ray.train import BackendConfig, ControllerError, DataConfig, RunConfig, ScalingConfig
from ray.train.v2._internal.execution.context import TrainRunContext
from ray.train.v2._internal.execution.controller.state import (
    ReschedulingState,
    RestartingState,
    RunningState,
)

from raytrain_ddp.controller.callbacks import ClusterRecount

_probes = itertools.count()


def _restart_the_coordinator() -> None:
    """Ray's coordinator in a new process (it restarts when killed): its own tick 20 s away."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    before = ray.get(coordinator.__ray_call__.remote(lambda _: os.getpid()))
    ray.kill(coordinator, no_restart=False)
    deadline = time.monotonic() + 60
    while ray.get(coordinator.__ray_call__.remote(lambda _: os.getpid())) == before:
        assert time.monotonic() < deadline, "Ray's autoscaling coordinator did not restart within 60 s"
        time.sleep(0.1)


def _expired_request():
    """A request of the coordinator's that has just expired; returns whether it is still held (no
    tick since)."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    for _ in range(3):  # a tick of its own within the 0.2 s (a new process ticks as it starts): ask again
        probe = f"probe-{next(_probes)}"
        ray.get(coordinator.request_resources.remote(probe, [{"CPU": 0.1}], expire_after_s=0.1))
        time.sleep(0.2)
        if ray.get(coordinator.get_reserved_resources.remote(probe)):
            return lambda: bool(ray.get(coordinator.get_reserved_resources.remote(probe)))
    raise AssertionError("the expired request, held until a tick: dropped three times in 0.2 s")


def _recounts(hook) -> bool:
    """Whether calling `hook` made the coordinator tick."""
    still_held = _expired_request()
    hook()
    return not still_held()


def test_the_recount_ticks_ray_s_coordinator_where_ray_train_sizes_the_workers(ray_session):
    _restart_the_coordinator()
    recount = ClusterRecount(resize_check_s=1.0)  # a recount 0.5 s before each of Ray Train's checks
    context = TrainRunContext(
        run_config=RunConfig(name="recount"),
        train_loop_config=None,
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        backend_config=BackendConfig(),
        dataset_config=DataConfig(),
    )
    assert _recounts(lambda: recount.after_controller_start(context))
    assert recount.requester == f"train-{context.run_id}"  # Ray Train's name for the run's request

    failed = ControllerError(RuntimeError("a worker's node was lost"))
    assert not _recounts(lambda: recount.after_controller_state_update(RunningState(), RunningState()))
    assert _recounts(lambda: recount.after_controller_state_update(RunningState(), RestartingState(failed)))
    assert _recounts(lambda: recount.after_controller_state_update(RestartingState(failed), ReschedulingState(failed)))
    assert not _recounts(lambda: recount.after_controller_state_update(ReschedulingState(failed), RunningState()))

    assert not _recounts(lambda: recount.after_worker_group_poll_status(None))  # no worker group yet
    recount.after_worker_group_start(None)
    assert not _recounts(lambda: recount.after_worker_group_poll_status(None))  # Ray Train's check is 1 s away
    time.sleep(0.5)
    assert _recounts(lambda: recount.after_worker_group_poll_status(None))  # ~0.5 s before it
    assert not _recounts(lambda: recount.after_worker_group_poll_status(None))  # the next, 1 s later
    time.sleep(1.0)
    assert _recounts(lambda: recount.after_worker_group_poll_status(None))
    recount.after_worker_group_shutdown(None)
    time.sleep(1.0)
    assert not _recounts(lambda: recount.after_worker_group_poll_status(None))  # none between groups
