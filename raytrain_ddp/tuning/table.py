"""What a sweep's user sees: the trials as they go (a live table on a terminal, a line per event in a
log), the summary at the end, and the plot of the score against each searched value.

`Trials` is a Ray Tune callback: it runs in the sweep's driver, in Tune's loop, and never raises.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from ray import tune
from rich.console import Console
from rich.live import Live
from rich.table import Table

from raytrain_ddp.cluster import capacity
from raytrain_ddp.config.search import Space
from raytrain_ddp.driver.console import PLACEMENT_GROUP
from raytrain_ddp.tuning.trial import mark_stopped, trained_to_the_end

logger = logging.getLogger(__name__)
REDRAW_S = 1.0


@dataclass(frozen=True)
class Row:
    """A trial as the table shows it."""

    name: str  # its run's name: <sweep>-t003
    values: dict[str, Any]  # the sampled values
    status: str  # pending, running, finished, stopped, failed
    epoch: float
    score: float | None  # its best so far

    def cells(self, keys: list[str], best: bool) -> list[str]:
        shown = "–" if self.score is None else f"{self.score:.4g}"
        return [
            self.name.rsplit("-", 1)[-1],  # t003: the sweep's name is in the title
            *(_value(self.values.get(k)) for k in keys),
            self.status,
            f"{self.epoch:g}",
            f"{shown}{' ★' if best else ''}",
        ]


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Trials(tune.Callback):
    """The sweep's trials as they go: a table redrawn in place on a terminal, else a line per result,
    stop and failure. Notes each trial the scheduler stops (`trial.mark_stopped`)."""

    def __init__(self, spaces: list[Space], score: str, order: str, epochs: int, storage_path: str):
        self.keys, self.score, self.order, self.epochs = [s.key for s in spaces], score, order, epochs
        self.storage_path = storage_path
        self.best: dict[str, float] = {}  # each trial's best score so far
        self.console: Console | None = None
        self._live: Live | None = None
        self._drawn = 0.0

    def __getstate__(self) -> dict[str, Any]:  # Tune keeps its callbacks with the sweep: no console, no display
        return {**self.__dict__, "console": None, "_live": None}

    def __setstate__(self, state: dict[str, Any]) -> None:  # a restored sweep's: shown on the standard output
        self.__dict__.update(state)
        self.show_on(Console(soft_wrap=True))

    def show_on(self, console: Console) -> None:
        self.console = console
        if console.is_terminal:
            self._live = Live(console=console, auto_refresh=False, transient=False)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self._safely(self._result, trial, result)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._safely(self._complete, trial)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._safely(self._say, f"{trial}: failed (its run's error is in the sweep's log: {trial.local_path})")

    def on_step_end(self, iteration, trials, **info) -> None:
        if self._live is not None and time.monotonic() - self._drawn >= REDRAW_S:
            self._safely(self._draw, trials)

    def on_experiment_end(self, trials, **info) -> None:
        if self._live is not None:
            self._safely(self._draw, trials)
            self._live.stop()

    def _result(self, trial, result: dict[str, Any]) -> None:
        value = float(result.get(self.score, math.nan))
        if not math.isnan(value):
            previous = self.best.get(str(trial))
            if previous is None or (value < previous if self.order == "min" else value > previous):
                self.best[str(trial)] = value
        if self._live is None:
            values = ", ".join(f"{k}={_value(v)}" for k, v in trial.config.items())
            self._say(f"{trial} ({values}): epoch {result.get('epoch', 0):g}/{self.epochs} {self.score} {value:.4g}")

    def _complete(self, trial) -> None:
        epoch = (trial.last_result or {}).get("epoch", 0)
        # Stopped by the scheduler (at the last epoch too), Tune ended the trial's process, and its run's
        # controller with it, before the controller removed its workers' placement group.
        if group := (trial.last_result or {}).get(PLACEMENT_GROUP):
            capacity.remove(group)
        run_path = f"{self.storage_path}/{trial}"
        if epoch < self.epochs and not trained_to_the_end(run_path, self.epochs):
            # the scheduler stopped it: noted, so a restored sweep stands by it. (Its epochs may outrun
            # Tune's reading of its reports: one whose last epoch's checkpoint is whole had finished.)
            mark_stopped(run_path, trial.last_result)
            self._say(f"{trial}: stopped by the scheduler at epoch {epoch:g} (trailing the others)")
        else:
            self._say(f"{trial}: finished")

    def _say(self, line: str) -> None:
        if self._live is None and self.console is not None:
            self.console.print(line, markup=False, highlight=False)

    def _draw(self, trials) -> None:
        self._drawn = time.monotonic()
        self._live.update(table([self._row(t) for t in trials], self.keys, self.score, self.order), refresh=True)
        if not self._live.is_started:
            self._live.start()

    def _row(self, trial) -> Row:
        last = trial.last_result or {}
        epoch = float(last.get("epoch", 0))
        status = {"PENDING": "pending", "RUNNING": "running", "ERROR": "failed", "PAUSED": "paused"}.get(trial.status)
        if status is None:
            status = "finished" if epoch >= self.epochs else "stopped"
        return Row(str(trial), dict(trial.config), status, epoch, self.best.get(str(trial)))

    def _safely(self, call, *args) -> None:
        try:
            call(*args)
        except Exception as e:  # noqa: BLE001 - the display must never end a sweep
            logger.warning("the sweep's table not updated: %s", e)


def table(rows: list[Row], keys: list[str], score: str, order: str) -> Table:
    """The trials, the best score first, the best trial starred."""
    ranked = ranked_rows(rows, order)
    shown = Table(box=None, pad_edge=False, title=ranked[0].name.rsplit("-", 1)[0] if ranked else None)
    for column in ["trial", *keys, "status", "epoch", f"best {score}"]:
        shown.add_column(column, justify="left" if column in ("trial", "status") else "right")
    for i, row in enumerate(ranked):
        shown.add_row(*row.cells(keys, best=(i == 0 and row.score is not None)))
    return shown


def ranked_rows(rows: list[Row], order: str) -> list[Row]:
    sign = 1 if order == "min" else -1
    return sorted(rows, key=lambda r: (r.score is None, sign * (r.score or 0.0), r.name))


def plot(rows: list[Row], spaces: list[Space], score: str, path: str) -> None:
    """The best score of each trial against each searched value: a panel per key; stopped trials hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [r for r in rows if r.score is not None]
    fig, axes = plt.subplots(1, len(spaces), figsize=(4.5 * len(spaces), 3.6), squeeze=False)
    for ax, space in zip(axes[0], spaces, strict=True):
        for stopped in (False, True):
            shown = [r for r in scored if (r.status == "stopped") == stopped]
            xs = [r.values[space.key] if _numeric(space) else str(r.values[space.key]) for r in shown]
            ax.scatter(
                xs,
                [r.score for r in shown],
                facecolors="none" if stopped else "C0",
                edgecolors="C0",
                label="stopped early" if stopped else "trained to the end",
            )
        numbers = [float(v) for v in space.values] if _numeric(space) else []
        if space.log or (numbers and min(numbers) > 0 and max(numbers) >= 100 * min(numbers)):  # decades apart
            ax.set_xscale("log")
        ax.set_xlabel(space.key)
        ax.set_ylabel(score)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _numeric(space: Space) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in space.values)
