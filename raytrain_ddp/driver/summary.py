"""What a run returns and prints when it ends: `RunSummary`, and its table on the console."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape

from raytrain_ddp.driver.console import is_quality_metric, throughput
from raytrain_ddp.driver.plan import ResumePoint
from raytrain_ddp.registry import records


@dataclass(frozen=True)
class RunSummary:
    run_name: str
    run_path: str  # <storage_path>/<run name>: the checkpoints
    epochs: int  # epochs completed
    workers: int
    metrics: dict[str, Any]  # reported with the best checkpoint: the registered model's
    final_metrics: dict[str, Any]  # of the last epoch
    best_checkpoint: str
    model: records.RegisteredModel | None  # None: not registered (mlflow.register); `registration` says why
    registration: str  # what registration decided and why, with the command that registers anyway; "" = new version
    mlflow_run_id: str
    artifacts: list[str]  # the recipe's text artifacts in the MLflow run
    tracking_uri: str
    ui_command: str
    extend_command: str  # resumes the run with train.epochs=N: train it longer
    wall_time_s: float
    resumed: ResumePoint  # where this driver found the run: a new run, or its checkpoint
    attempts: int  # 1 + restarts of the workers after failures; 0: nothing trained (already_finished)
    failures: list[str]  # one line per failed attempt: which rank failed, how, and where it restarted
    already_finished: bool = False  # the run had finished before, its registration decided: nothing was done
    stopped_early: str | None = None  # why early stopping ended the run before train.epochs (None: it did not)
    patience_spent: bool = False  # early stopping's patience is spent (maybe at the last epoch): more epochs end
    skipped_files: list[str] = field(default_factory=list)  # unreadable files left out, a line each


def show(console: Console, summary: RunSummary) -> None:
    best = summary.metrics
    rows = [(f"{k} (global)", f"{v:.4f}") for k, v in best.items() if is_quality_metric(k, v) and k != "train_loss"]
    workers = best.get("workers", summary.workers)  # reported with it: an elastic run's may change
    rows += [
        ("validation samples", f"{best.get('val_samples')} (each counted once across {workers} workers)"),
        ("throughput", f"{throughput(summary.final_metrics)} (last epoch)"),
        ("best checkpoint", f"{summary.best_checkpoint}  (epoch {best.get('epoch'):.4g}, step {best.get('step')})"),
        *_registration_rows(summary),
        ("MLflow run", f"{summary.mlflow_run_id}  in {summary.tracking_uri}"),
        *([("artifacts", ", ".join(summary.artifacts))] if summary.artifacts else []),
        *([("skipped files", _skipped(summary.skipped_files))] if summary.skipped_files else []),
        ("MLflow UI", summary.ui_command),
        ("train longer", _train_longer(summary)),
    ]
    resumed = summary.resumed
    if resumed.checkpoint and not summary.already_finished:
        rows.insert(0, ("resumed from", f"{resumed.checkpoint} (epoch {resumed.epoch:.4g}, step {resumed.step})"))
    if summary.stopped_early:
        rows.insert(0, ("stopped early", summary.stopped_early))
    if summary.failures:
        restarts = "; ".join(f"{i}: {failure}" for i, failure in enumerate(summary.failures, 1))
        rows.insert(0, ("attempts", f"{summary.attempts}, after failures: {restarts}"))
    minutes, seconds = divmod(round(summary.wall_time_s), 60)
    epochs = f"{summary.epochs} epoch{'s' if summary.epochs != 1 else ''}"
    if summary.already_finished:
        longer = f"{summary.extend_command} with N > {summary.epochs}"
        longer = _train_longer(summary) if summary.stopped_early else longer
        registered = "is registered" if summary.model is not None else "is not registered (see below)"
        console.print(
            f"[bold]{summary.run_name}[/] has already finished training ({epochs}) and its model {registered}: "
            f"nothing to do. To train it longer: {escape(longer)}",
            highlight=False,
        )
    else:
        early = " (stopped early)" if summary.stopped_early else ""
        console.print(f"\n[bold]{summary.run_name}[/] finished{early}: {epochs} in {minutes}m {seconds:02d}s")
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        console.print(f"  [bold]{key:<{width}}[/]  {escape(value)}", soft_wrap=True, highlight=False)


def _skipped(lines: list[str], shown: int = 3) -> str:
    more = f", and {len(lines) - shown} more" if len(lines) > shown else ""
    listed = f"{'; '.join(lines[:shown])}{more}"
    return f"{len(lines)} unreadable, left out: {listed} (all: MLflow artifact {records.SKIPPED_FILES})"


def _train_longer(summary: RunSummary) -> str:
    if summary.patience_spent:  # more epochs alone: the run would end at once
        return f"{summary.extend_command} train.early_stopping.patience=null  (or a larger patience)"
    return f"{summary.extend_command}  (N > {summary.epochs})"


def _registration_rows(summary: RunSummary) -> list[tuple[str, str]]:
    model, note = summary.model, summary.registration
    if model is None:
        return [("registered model", note)]
    return [
        ("registered model", f"{model.name}  version {model.version}" + (f"  ({note})" if note else "")),
        *([("registry alias", model.champion)] if model.champion else []),
        ("model URI", model.uri),
    ]
