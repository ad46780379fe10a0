"""What the user sees: a line per epoch as the reports arrive, and a summary at the end.

Reports reach the Ray Train controller, not the driver; `ProgressRelay` (a controller callback) puts
each one on a Ray queue that `LiveProgress` drains on the driver while `fit()` runs.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import ray.train
from ray.util.queue import Empty, Queue
from rich.console import Console

if TYPE_CHECKING:
    from raytrain_ddp.driver import RunSummary

logger = logging.getLogger(__name__)


class ProgressRelay(ray.train.UserCallback):
    """Runs on the controller: forwards rank 0's metrics of every report to the driver."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        try:  # a display problem must never end the run (controller errors are not retried)
            self.queue.put(metrics[0], timeout=5)
        except Exception as e:  # noqa: BLE001
            logger.warning("progress line for epoch %s not shown: %s", metrics[0].get("epoch"), e)


class LiveProgress:
    """Prints a line per epoch while training runs; a spinner shows the phase on a terminal."""

    def __init__(self, console: Console, *, epochs: int, score: str, order: str, workers: int):
        self.console, self.epochs, self.score, self.order = console, epochs, score, order
        self.queue = Queue(actor_options={"num_cpus": 0})
        self.relay = ProgressRelay(self.queue)
        self.best: float | None = None
        self._status = console.status(f"Starting {workers} training workers…")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)

    def __enter__(self) -> "LiveProgress":
        self._status.start()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._status.stop()
        ray.kill(self.queue.actor)

    def _drain(self) -> None:
        while True:
            try:
                self._show(self.queue.get(timeout=0.5))
            except Empty:
                if self._stop.is_set():
                    return

    def _show(self, m: dict[str, Any]) -> None:
        score = m.get(self.score)
        improved = score is not None and (
            self.best is None or (score > self.best if self.order == "max" else score < self.best)
        )
        if improved:
            self.best = score
        values = "  ".join(f"{k} [bold]{v:.4f}[/]" for k, v in m.items() if _is_quality_metric(k, v))
        best = "  [green]★ best[/]" if improved else ""
        self.console.print(
            f"epoch {m['epoch']:>3}/{self.epochs}  {values}  [dim]{m['epoch_time_s']:.1f}s, {_throughput(m)}[/]{best}"
        )
        self._status.update(f"Training… epoch {m['epoch']}/{self.epochs} done")


def print_summary(console: Console, summary: "RunSummary") -> None:
    best = summary.metrics
    rows = [(f"{k} (global)", f"{v:.4f}") for k, v in best.items() if _is_quality_metric(k, v) and k != "train_loss"]
    rows += [
        ("validation samples", f"{best.get('val_samples')} (each counted once across {summary.workers} workers)"),
        ("throughput", f"{_throughput(summary.final_metrics)} (last epoch)"),
        ("best checkpoint", f"{summary.best_checkpoint}  (epoch {best.get('epoch')})"),
        ("registered model", f"{summary.model.name}  version {summary.model.version}"),
        ("model URI", summary.model.uri),
        ("MLflow run", f"{summary.mlflow_run_id}  in {summary.tracking_uri}"),
        *([("artifacts", ", ".join(summary.artifacts))] if summary.artifacts else []),
        ("MLflow UI", summary.ui_command),
        ("train longer", f"{summary.extend_command}  (N > {summary.epochs})"),
    ]
    minutes, seconds = divmod(round(summary.wall_time_s), 60)
    epochs = f"{summary.epochs} epoch{'s' if summary.epochs != 1 else ''}"
    console.print(f"\n[bold]{summary.run_name}[/] finished: {epochs} in {minutes}m {seconds:02d}s")
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        console.print(f"  [bold]{key:<{width}}[/]  {value}", soft_wrap=True, highlight=False)


def _is_quality_metric(key: str, value: Any) -> bool:
    """train_loss and the recipe's val_* metrics; not counts, times or per-worker lists."""
    return (key == "train_loss" or key.startswith("val_")) and "samples" not in key and isinstance(value, float)


def _throughput(m: dict[str, Any]) -> str:
    tokens = f"{m['tokens_per_s']:,.0f} tokens/s, " if "tokens_per_s" in m else ""
    return f"{m['samples_per_s']:,.0f} samples/s, {tokens}{m['data_wait_fraction']:.0%} waiting for data"
