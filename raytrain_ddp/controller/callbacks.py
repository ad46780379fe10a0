"""What runs on Ray Train's controller: `ProgressRelay` and `ControllerMarks` put reports, failures and
the worker group's phases on the driver's queue (where the console shows them and
`tracking.MetricsLog` logs each report's metrics to MLflow); `ClusterRecount` keeps an elastic run's
count of the cluster current.

Kept light to import: the controller imports this module (to unpickle the callbacks) before it
starts a worker, so an import here delays every run's first step: no torch (a second and more), no
mlflow (a second and more, and the store opened: MLflow is the driver's alone). (Ray Train also sends
the run's callbacks to every worker with its run context, where they do nothing.)
"""

from __future__ import annotations

import logging
import pickle
import re
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.exceptions import RayActorError
from ray.util.queue import Queue

from raytrain_ddp.ray_compat import cluster as ray_compat
from raytrain_ddp.ray_compat.controller import ControllerCallback, WorkerGroupCallback, placement_group_id

logger = logging.getLogger(__name__)
# An elastic run's recount of the cluster comes this long before Ray Train's resize check (its polls are
# run.controller_poll_s apart: 0.5 s by default).
RECOUNT_LEAD_S = 1.0


class ProgressRelay(ray.train.UserCallback):
    """Runs on the controller: forwards rank 0's metrics of every report, and every failure of the
    workers (with the checkpoint the restart will resume from), to the driver."""

    def __init__(self, queue: Queue, latest: str | None):
        self.queue, self.latest = queue, latest

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if checkpoint is not None:
            self.latest = Path(checkpoint.path).name
        self._put(("report", metrics[0], self.latest))

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        if any(_preempted(e) for e in worker_exceptions.values()):  # ControllerMarks says it, once
            return
        errors = {rank: one_line(e) for rank, e in sorted(worker_exceptions.items())}
        run = run_context.run_config
        try:  # a checkpoint reported just before the failure, not recorded yet, is where the restart resumes
            from raytrain_ddp.checkpoint import format as ckpt  # here: it imports torch, which the controller needs not

            resumes = ckpt.newest_unrecorded(f"{run.storage_path}/{run.name}", self.latest) or self.latest
        except Exception:  # noqa: BLE001 - never end the run for the display's sake
            resumes = self.latest
        self._put(("failure", errors, resumes))

    def _put(self, event: tuple) -> None:
        try:  # a display problem must never end the run (controller errors are not retried)
            self.queue.put(event, timeout=5)
        except Exception as e:  # noqa: BLE001
            logger.warning("progress event not shown: %s", e)


class ControllerMarks(ControllerCallback, WorkerGroupCallback):
    """Runs on Ray Train's controller: the worker group's phases, put on the driver's queue as
    ("marks", {phase: time}). Never raises (a callback error would end the run)."""

    def __init__(self, queue):
        self.queue = queue

    def after_controller_start(self, train_run_context) -> None:
        self._put("controller")
        try:  # the driver's way to end the run when its resources do not come (run.resources_wait_s)
            # Pickled here: as a handle, the queue's actor would deserialize it, importing Ray Train's
            # controller module first (~1 s), and this put and every one behind it would wait that
            # long, holding up the worker group's start by as much in every run.
            controller = pickle.dumps(ray.get_runtime_context().current_actor)
            self.queue.put(("controller", controller, train_run_context.run_id), timeout=5)
        except Exception as e:  # noqa: BLE001
            logger.warning("the controller's handle not sent to the driver: %s", e)

    def before_worker_group_start(self, worker_group_context) -> None:
        self._put("placement")  # the scaling decision taken: the worker group's resources asked for

    def after_worker_group_start(self, worker_group) -> None:
        self._put("worker group")  # the worker actors up, their process group set up
        # which node each rank is on (a failure then says which node was lost, if one was), and the
        # workers' placement group (the driver removes it if the controller cannot: capacity.release)
        try:
            nodes = {w.distributed_context.world_rank: w.metadata.node_id for w in worker_group.get_workers()}
            self.queue.put(("workers", nodes, placement_group_id(worker_group)), timeout=5)
        except Exception as e:  # noqa: BLE001
            logger.warning("the workers' nodes not sent to the driver: %s", e)

    def after_worker_group_training_start(self, worker_group) -> None:
        self._put("train context")  # datasets split, the training function launched

    def after_controller_state_update(self, previous_state, current_state) -> None:
        """The controller's state, when it changes: whether it is deciding how many workers to start
        (an elastic run below its minimum waits there, with no placement group to watch); a resize
        (an elastic run's room changed); a preemption begun (a node of the workers is
        being drained) or over (the workers restart, or the run ends). Ray Train calls no other
        callback for these."""
        was, now = type(previous_state).__name__, type(current_state).__name__
        if was == now:  # called at every poll
            return
        try:
            self.queue.put(("state", now), timeout=5)
        except Exception as e:  # noqa: BLE001
            logger.warning("the controller's state not shown: %s", e)
        try:
            if now == "ResizingState":
                self.queue.put(("resizing", current_state.scaling_decision.num_workers), timeout=5)
            elif now == "PreemptingState":
                info = current_state.preemption_info
                self.queue.put(("preempting", info.preempted_node_to_ranks, info.deadline_ms), timeout=5)
            elif was == "PreemptingState":
                self.queue.put(("preempted", now == "RestartingState"), timeout=5)
        except Exception as e:  # noqa: BLE001
            logger.warning("a resize or preemption not shown: %s", e)

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if worker_group_status.finished and not worker_group_status.errors:
            self._put("workers done")

    def after_worker_group_shutdown(self, worker_group_context) -> None:
        self._put("worker group stopped")

    def _put(self, phase: str) -> None:
        try:
            self.queue.put(("marks", {phase: time.time()}), timeout=5)
        except Exception as e:  # noqa: BLE001
            logger.warning("timeline mark %s not kept: %s", phase, e)


class ClusterRecount(ControllerCallback, WorkerGroupCallback):
    """Runs on the controller of an elastic run: has Ray count the cluster's nodes again just before
    Ray Train sizes the workers from that count. Ray Train's elastic policy sizes them from what Ray's
    autoscaling coordinator reserves for the run, and the coordinator counts the alive nodes only every
    20 s (its tick): a node lost a moment ago was still counted, so the restart asked for a worker on it
    and waited out the placement's timeout before asking again, and a node that joined was seen up to
    20 s late. Recounted as the controller starts, as it is about to size the workers again (after a
    failure, or a placement that timed out), and just before each of Ray Train's resize checks (every
    scaling.resize_check_s from the worker group's start). Never raises: Ray's own tick remains."""

    def __init__(self, resize_check_s: float):
        self.resize_check_s = resize_check_s
        self.lead_s = min(RECOUNT_LEAD_S, resize_check_s / 2)  # how long before Ray Train's check
        self.requester, self.next_recount = None, float("inf")

    def after_controller_start(self, train_run_context) -> None:
        self.requester = f"train-{train_run_context.run_id}"  # Ray Train's name for the run's request
        self._recount()

    def after_controller_state_update(self, previous_state, current_state) -> None:
        now = type(current_state).__name__
        if now in ("RestartingState", "ReschedulingState") and now != type(previous_state).__name__:
            self._recount()

    def after_worker_group_start(self, worker_group) -> None:
        # Ray Train checks for room every resize_check_s from the worker group's start, timed by the
        # same monotonic clock in this same process (the controller's).
        self.next_recount = time.monotonic() + self.resize_check_s - self.lead_s

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        now = time.monotonic()
        if now >= self.next_recount:
            self.next_recount = now + self.resize_check_s
            self._recount()

    def after_worker_group_shutdown(self, worker_group_context) -> None:
        self.next_recount = float("inf")

    def _recount(self) -> None:
        ray_compat.recount_nodes(self.requester)  # `recompute`: the coordinator's tick, now


def _preempted(error: BaseException) -> bool:
    """Whether a worker died with its node, drained for a preemption (Ray Train's own test)."""
    error = getattr(error, "health_check_failure", error)
    return isinstance(error, RayActorError) and bool(getattr(error, "preempted", False))


def one_line(error: BaseException) -> str:
    """A worker's failure in one line: the exception it raised, or how its process died."""
    # Ray Train wraps both kinds: a dead worker's error, and the user's exception with its traceback.
    error = getattr(error, "health_check_failure", error)
    if isinstance(error, RayActorError):
        detail = re.search(r"Worker exit detail: (.*?)\.", str(error))
        return f"the worker process died ({detail.group(1) if detail else type(error).__name__})"
    error = getattr(error, "_base_exc", error)
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    last = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[-1]) if lines else ""  # gloo's source location
    last = f"{type(error).__name__}: {last}"
    if len(last) > 120:  # the first sentence says it (gloo goes on for three more)
        last = re.split(r"(?<=\.) ", last, maxsplit=1)[0]
    return last if len(last) <= 200 else last[:199] + "…"
