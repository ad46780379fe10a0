"""What the user sees while a run trains: the plan in a line, a line per report as they arrive, a line
per failed attempt, and between reports the live progress (progress.py). (The summary at the end is
`summary.py`'s.)

Reports and failures reach the Ray Train controller, not the driver; `callbacks.ProgressRelay` (a
controller callback) puts each on a Ray queue that `LiveProgress` drains on the driver while `fit()` runs.
Rank 0 puts its progress on the same queue (`progress.Beacon`).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray.train
from ray.train import WorkerGroupError
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console
from rich.markup import escape

from raytrain_ddp.checkpoint.format import position, rank
from raytrain_ddp.cluster import capacity
from raytrain_ddp.cluster.session import ELASTIC_PLACEMENT_WAIT_S
from raytrain_ddp.config.layering import yaml_value
from raytrain_ddp.controller.callbacks import ControllerMarks, ProgressRelay, one_line
from raytrain_ddp.data import stream
from raytrain_ddp.driver.progress import Progress
from raytrain_ddp.driver.timeline import MARKS, Timeline
from raytrain_ddp.worker.flops import si
from raytrain_ddp.worker.metrics import GENERATED, STOPPED, STOPPED_EARLY, STORAGE_RETRIED
from raytrain_ddp.worker.progress import PROGRESS

if TYPE_CHECKING:
    from raytrain_ddp.driver.plan import Plan

logger = logging.getLogger(__name__)
END = "end"  # put by the driver once fit() has returned
PLACEMENT_GROUP = "placement_group"  # beside a report's metrics for `reported`: the workers' group, its hex id
WATCH_EVERY_S = 2.0  # how often the driver asks whether the workers wait for resources
ANNOUNCE_AFTER_S = 10.0  # a placement that waits longer is said on the console (a healthy one takes < 1 s)
# Ray Train's controller states of deciding how many workers to start: an elastic run below its
# minimum stays there (Ray's elastic policy waits without a placement group, and says nothing).
DECIDING = ("InitializingState", "RestartingState", "ReschedulingState")
DECIDING_FOR_S = 12.0  # longer is a wait: an elastic decision asks Ray's autoscaling coordinator (5 s at most), twice


class LiveProgress:
    """Prints a line per report while training runs, and a line per failed attempt; a spinner shows
    the phase on a terminal, and the live progress between reports (elsewhere, a progress line every
    run.progress_log_s). Keeps what the driver needs afterwards: the failures, and why the run
    stopped if the workers stopped it.

    Watches for workers that wait for resources (Ray's placement group of this driver's job pending,
    or, for an elastic run below its minimum, Ray Train's controller deciding how many to start), at
    the start or after a node is lost: says what they wait for and what the cluster has, and
    after run.resources_wait_s ends the run (`gave_up` says why) instead of Ray's endless retries."""

    def __init__(
        self,
        console: Console,
        plan: Plan,
        timeline: Timeline,
        reported: Callable[[dict[str, Any]], None] | None = None,
        training: Callable[[], None] | None = None,
    ):
        config = plan.config
        self.timeline = timeline  # the phases of the worker group (ControllerMarks) and of rank 0 (its reports)
        self.reported = reported  # called with every report's metrics, in order (tracking.MetricsLog.add)
        self.training = training  # called once, as rank 0's first progress or report arrives: the ranks train
        self.console, self.epochs = console, config.train.epochs
        self.score, self.order = config.checkpoint.score_attribute, config.checkpoint.score_order
        self.max_failures, self.latest = config.run.max_failures, plan.resume.checkpoint
        self.relay: ProgressRelay | None = None  # for the trainer's callbacks, from __enter__ on
        self.marks: ControllerMarks | None = None
        # The rank of the run's best checkpoint so far (a resumed run's included): ★ marks a report
        # whose checkpoint becomes the best, by the rule registration follows (checkpoint.rank).
        self.best = None if plan.resume.best is None else rank(plan.resume.best, self.score, self.order)
        self.failures: list[str] = []  # every failed attempt, preemptions and resizes included
        self._counted = 0  # those that count against run.max_failures (not preemptions nor resizes)
        self.lost: list[str] = []  # the nodes lost with the latest failed attempt, described
        self.stopped: str | None = None
        self.config, self.gave_up = config, None  # gave_up: why the driver ended the run, if it did
        self._controller = None  # Ray Train's controller actor, pickled, and its run's id (ControllerMarks sends them)
        self._run_id = None
        self._worker_nodes: dict[int, str] = {}  # rank: node id, of the latest worker group
        self.placement_group: str | None = None  # the latest worker group's, its hex id (ControllerMarks)
        self._preemption = ""  # the preemption under way, as said
        self._waiting_since: float | None = None  # since when the workers wait for resources
        self._deciding_since: float | None = None  # since when Ray Train's controller decides how many workers
        self._next_watch, self._announced = 0.0, False
        self._status = console.status(f"Starting {config.scaling.workers_text}…")
        steps = plan.steps_per_epoch
        self.progress = Progress(steps * self.epochs, plan.train_rows / steps, self.epochs)
        self._live = console.is_terminal  # else a line every run.progress_log_s, no control characters
        self._progress_line_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)

    def __enter__(self) -> LiveProgress:
        # On the driver's node: a node of the cluster may be lost, this one never without the driver.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.relay = ProgressRelay(self.queue, self.latest)
        self.marks = ControllerMarks(self.queue)
        self._status.start()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):  # behind every event already put: the drain ends at once
            self.queue.put((END,), timeout=5)
        self._thread.join()
        self._status.stop()
        with contextlib.suppress(Exception):  # gone already, with a Ray that went down
            ray.kill(self.queue.actor)

    def _drain(self) -> None:
        while True:
            try:
                kind, *event = self.queue.get(timeout=0.5)
            except Empty:
                if self._stop.is_set():
                    return
                self._watch()
                continue
            except Exception as e:  # noqa: BLE001 - the queue's actor gone with its node or Ray: fit() says why
                logger.warning("progress display stopped: %s", one_line(e))
                return
            if kind == END:
                return
            handler = {
                "marks": self._on_marks,
                "controller": self._on_controller,
                "workers": self._on_workers,
                "state": self._on_state,
                "resizing": self._resizing,
                "preempting": self._preempting,
                "preempted": self._preempted,
                PROGRESS: self._on_progress,
                "report": self._on_report,
                "failure": self._on_failure,
            }.get(kind)
            if handler is not None:
                handler(*event)
            self._watch()

    def _on_marks(self, marks: dict[str, float]) -> None:
        self.timeline.add(marks)
        if "worker group" in marks:  # the workers placed and started
            self._placed()

    def _on_controller(self, controller: bytes, run_id: str) -> None:
        self._controller, self._run_id = controller, run_id
        if self.config.scaling.elastic:  # it starts by deciding how many workers to start
            self._deciding_since = time.monotonic()

    def _on_workers(self, nodes: dict[int, str], placement_group: str | None = None) -> None:
        self._worker_nodes, self.placement_group = nodes, placement_group

    def _on_state(self, state: str) -> None:
        if self.config.scaling.elastic:
            deciding = state in DECIDING
            self._deciding_since = (self._deciding_since or time.monotonic()) if deciding else None

    def _on_progress(self, note: dict[str, Any]) -> None:
        self._began()
        self._progressed(note)

    def _on_report(self, metrics: dict[str, Any], latest: Any) -> None:
        self._began()
        self.latest = latest
        self._deciding_since = None
        self.timeline.add(metrics.pop(MARKS, {}))
        if self.reported is not None:  # with the workers' placement group (a sweep's trial passes it on)
            self.reported(metrics | ({PLACEMENT_GROUP: self.placement_group} if self.placement_group else {}))
        self._show(metrics)

    def _on_failure(self, *event: Any) -> None:
        self.progress.restart()
        self._failed(*event)

    def _began(self) -> None:
        if self.training is not None:
            began, self.training = self.training, None
            began()

    def _progressed(self, note: dict[str, Any]) -> None:
        self.progress.add(note)
        now = time.monotonic()
        if self._live:
            self._status.update(self.progress.renderable())
        elif now - self._progress_line_at >= self.config.run.progress_log_s:
            self._progress_line_at = now
            self.console.print(f"progress: {self.progress.text()}", highlight=False, markup=False)

    def _preempting(self, node_ranks: dict[str, list[int]], deadline_ms: int | None) -> None:
        nodes = "; ".join(f"node {node[:8]} (rank {', '.join(map(str, ranks))})" for node, ranks in node_ranks.items())
        when = f", reclaimed in {max(deadline_ms / 1000 - time.time(), 0):.0f} s" if deadline_ms else ""
        self._preemption = f"{nodes} preempted (drained{when})"
        then = "a checkpoint now, then the workers wait for the restart"
        self.console.print(f"[yellow]preempting[/]: {escape(self._preemption)}: {then}")

    def _preempted(self, restarting: bool) -> None:
        if not restarting:  # the run ended first (finished, or failed otherwise)
            return
        restart = f"restarted from {self._resumes_from(self.latest)} (not counted in run.max_failures)"
        self.progress.restart()
        self.failures.append(f"{self._preemption} — {restart}")
        self.console.print(f"[yellow]attempt {len(self.failures)} ended[/]: {escape(self.failures[-1])}")
        self._status.update("Restarting the workers after the preemption…")

    def _resizing(self, workers: int) -> None:
        """Ray Train resizes an elastic run whose room changed (it looks every scaling.resize_check_s):
        an attempt ended, not failed."""
        restart = f"restarted from {self._resumes_from(self.latest)} (not counted in run.max_failures)"
        self.progress.restart()
        self.failures.append(f"resized from {len(self._worker_nodes)} to {workers} workers — {restart}")
        self.console.print(f"[yellow]attempt {len(self.failures)} ended[/]: {escape(self.failures[-1])}")
        self._status.update(f"Restarting on {workers} workers…")

    def _resumes_from(self, latest: str | None) -> str:
        """Where the workers restart: `latest`, except that an elastic run restarted on another number
        of workers passes over a mid-epoch checkpoint (checkpoint.resumable_on)."""
        if latest is None:
            return "the start"
        where = position(latest)
        if self.config.scaling.elastic and where is not None and where[1] == 0:
            return f"{latest} (on another number of workers, the epoch's end before it)"
        return latest

    def _watch(self) -> None:
        """Every WATCH_EVERY_S: whether the workers wait for resources; said after ANNOUNCE_AFTER_S, and
        the run ended after run.resources_wait_s (0: at the second look)."""
        now = time.monotonic()
        if now < self._next_watch or self.gave_up is not None:
            return
        self._next_watch = now + WATCH_EVERY_S
        deciding = self._deciding_since is not None and now - self._deciding_since >= DECIDING_FOR_S
        if not (deciding or self._placement_pending()):
            return
        if self._waiting_since is None:
            self._waiting_since = now
            return
        # An elastic run's placement may wait ELASTIC_PLACEMENT_WAIT_S for a node lost a moment ago,
        # before Ray Train asks again for as many workers as fit: part of a shrink, not a wait. (A run
        # below its minimum, deciding, has no placement to wait for: its wait counts at once.)
        grace = ELASTIC_PLACEMENT_WAIT_S if self.config.scaling.elastic and not deciding else 0.0
        waited, limit = now - self._waiting_since - grace, self.config.run.resources_wait_s
        if waited < 0:
            return
        if waited >= limit:
            self.gave_up = (
                f"the workers' resources did not come within {limit:g} s (run.resources_wait_s): "
                f"{capacity.describe_wait(self.config)}"
            )
            self.console.print(f"[red]giving up[/]: {escape(self.gave_up)}")
            self._abort()
        elif not self._announced and waited >= ANNOUNCE_AFTER_S:
            self._announced = True
            self.console.print(
                f"[yellow]waiting for resources[/] ({waited:.0f} s; the run fails after {limit:g} s, "
                f"run.resources_wait_s): {escape(capacity.describe_wait(self.config))}"
            )
        self._status.update(f"Waiting for the workers' resources ({waited:.0f} of {limit:g} s)…")

    def _placement_pending(self) -> bool:
        """Whether a placement group of this driver's job (Ray Train's controller creates the workers')
        waits for resources."""
        return any(state in ("PENDING", "RESCHEDULING") for state in capacity.placement_groups().values())

    def _placed(self) -> None:
        if self._announced:
            self.console.print(f"resources found after {time.monotonic() - self._waiting_since:.0f} s")
        self._waiting_since, self._deciding_since, self._announced = None, None, False

    def _abort(self) -> None:
        """End the run: Ray Train's controller is killed, and fit() raises. (Its `abort`, what Ctrl-C
        calls, waits behind the placement group's wait, a minute at a time.) There are no workers yet
        to stop; its request to Ray's autoscaling coordinator is withdrawn (`capacity.withdraw`), and
        the placement group it asked for is removed once fit() has raised (`capacity.release`)."""
        if self._controller is None:
            logger.warning("cannot end the run: the controller's handle never came")
            return
        ray.kill(pickle.loads(self._controller), no_restart=True)
        capacity.withdraw(self._run_id)

    def _show(self, m: dict[str, Any]) -> None:
        if STOPPED in m:
            self.stopped = m[STOPPED]
            self.console.print(f"[red]stopping[/]: {escape(self.stopped)}")
            return
        if STORAGE_RETRIED in m:
            self.console.print(f"[yellow]warning[/]: {escape(m[STORAGE_RETRIED])}")
        ranked = rank(m, self.score, self.order)
        improved = self.score in m and (self.best is None or ranked > self.best)
        if improved:
            self.best = ranked
        values = "  ".join(f"{k} [bold]{v:.4f}[/]" for k, v in m.items() if is_quality_metric(k, v))
        best = "  [green]★ best[/]" if improved else ""
        epoch = m["epoch"]
        where = (
            f"epoch {epoch:>3.0f}/{self.epochs}"
            if epoch == int(epoch)
            else f"  step {m['step']:>5} (epoch {epoch:.2f})"
        )
        workers = m.get("workers") if self.config.scaling.elastic else None  # an elastic run's may change
        on = f", {workers} worker{'s' * (workers != 1)}" if workers else ""
        self.console.print(f"{where}  {values}  [dim]{m['epoch_time_s']:.1f}s, {throughput(m)}{on}[/]{best}")
        self._progress_line_at = time.monotonic()  # a log's next progress line comes a whole interval later
        for sample in m.get(GENERATED, [])[:1]:  # what the model says now, in a line
            said = " ".join(sample.get("generated", "").split())
            self.console.print(f"  [dim]generated:[/] {escape(said[:100])}", highlight=False)
        if STOPPED_EARLY in m:
            self.console.print(f"[green]stopping early[/]: {escape(m[STOPPED_EARLY])}")
        self._status.update(f"Training… epoch {epoch:.4g}/{self.epochs}")

    def _failed(self, errors: dict[int, str], latest: str | None) -> None:
        what = "; ".join(f"rank {rank}: {error}" for rank, error in errors.items())
        lost = self.lost = capacity.lost_nodes(self._worker_nodes)
        if lost:  # the other ranks' errors (a collective cut short) follow from it
            what = "; ".join(lost) + f" ({what})"
        left = self.max_failures - self._counted - 1
        self._counted += 1
        if self.max_failures == -1 or left >= 0:
            restart = f"restarted from {self._resumes_from(latest)}"
            self._status.update(f"Restarting the workers from {latest or 'the start'}…")
        else:
            restart = f"no restarts left (run.max_failures={self.max_failures})"
        self.failures.append(f"{what} — {restart}")
        self.console.print(f"[yellow]attempt {len(self.failures)} failed[/]: {escape(self.failures[-1])}")


def show_plan(console: Console, plan: Plan) -> None:
    """The run in a line: what trains, on how many workers, where it starts from and where it writes."""
    config, t, resume = plan.config, plan.config.train, plan.resume
    accumulation = f" × {t.grad_accum_steps} accumulated" if t.grad_accum_steps > 1 else ""
    steps = plan.steps_per_epoch
    if resume.checkpoint:
        resuming = f", resuming from {resume.checkpoint} (epoch {resume.epoch:.4g}, step {resume.step})"
    elif plan.named:  # a run.name that was meant to resume, maybe, given in another directory
        resuming = f", new run (no checkpoint of a run {config.run.name} in {config.run.storage_path})"
    else:
        resuming = ""
    console.print(
        f"[bold]{config.run.name}[/]: job {plan.recipe.name}, {config.scaling.workers_text} × batch "
        f"{t.batch_size}{accumulation}, {plan.train_rows} training rows ({steps} steps/epoch){resuming}, "
        f"checkpoints in {plan.run_path}"
    )
    if plan.derived:
        found = ", ".join(f"{key}={yaml_value(value)}" for key, value in plan.derived.items())
        console.print(f"[dim]from the data: {escape(found)}[/]", highlight=False)
    for skipped in resume.skipped:
        console.print(f"[yellow]skipped checkpoint[/] {escape(str(skipped))}")
    for name, dataset in plan.datasets.items():
        for skipped in dataset.manifest.skipped if isinstance(dataset, stream.Stream) else ():
            console.print(f"[yellow]skipped unreadable {name} file[/] {escape(skipped)}")
    if config.scaling.use_gpu:  # where there is MFU to report
        console.print(f"[dim]{escape(plan.flops.describe())}[/]", highlight=False)


def describe_failure(error: BaseException, max_failures: int, failed_attempts: int, lost: Sequence[str] = ()) -> str:
    """What failed (the `lost` nodes first, whose loss the ranks' errors follow from), on which rank,
    after how many attempts: one line per rank, not Ray's tracebacks."""
    if isinstance(error, WorkerGroupError):
        ranks = "; ".join(f"rank {rank}: {one_line(e)}" for rank, e in sorted(error.worker_failures.items()))
        if lost:
            ranks = "; ".join(lost) + f" ({ranks})"
        return f"{ranks} (attempt {max(failed_attempts, 1)}; run.max_failures={max_failures})"
    return str(error)


def is_quality_metric(key: str, value: Any) -> bool:
    """train_loss and the recipe's val_* metrics; not counts, times or per-worker lists."""
    return (key == "train_loss" or key.startswith("val_")) and "samples" not in key and isinstance(value, float)


def throughput(m: dict[str, Any]) -> str:
    """Samples/s (tokens/s where counted), and on a GPU of known peak the model FLOP/s and MFU; with
    train.compile, the time the epoch's compiling batches took (not in those rates)."""
    tokens = f"{m['tokens_per_s']:,.0f} tokens/s, " if "tokens_per_s" in m else ""
    mfu = f"{si(m['model_flops_per_s'])}FLOP/s, MFU {m['mfu']:.1%}, " if "mfu" in m else ""
    compiling = f", {m['compile_s']:.1f} s compiling (not in the rates)" if m.get("compile_s") else ""
    waiting = f"{m['data_wait_fraction']:.0%} waiting for data"
    return f"{m['samples_per_s']:,.0f} samples/s, {tokens}{mfu}{waiting}{compiling}"
