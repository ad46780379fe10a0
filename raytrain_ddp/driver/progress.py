"""The driver's side of the live progress: `Progress` turns rank 0's notes (worker/progress.py's
`Beacon`) into what the console shows: the step, the loss, the rate and the time left."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from rich.console import RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

logger = logging.getLogger(__name__)
RATE_WINDOW = 30  # notes the rate (and so the ETA) is measured over: about a minute at 2 s


class Progress:
    """The driver's view of the newest note: steps out of the run's total, the step rate over the
    last RATE_WINDOW notes of the current attempt (a restart measures afresh), and what is left."""

    def __init__(self, total_steps: int, rows_per_step: float, epochs: int):
        self.total_steps, self.rows_per_step, self.epochs = total_steps, rows_per_step, epochs
        self.started = time.monotonic()
        self.latest: dict[str, Any] | None = None
        self._window: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_WINDOW)

    def add(self, note: dict[str, Any]) -> None:
        if self._window and note["step"] < self._window[-1][1]:  # a restarted attempt's, from a checkpoint
            self._window.clear()
        self.latest = note
        self._window.append((note["time"], note["step"]))

    def restart(self) -> None:
        """The workers restart (a failure, a preemption, a resize): the rate so far says nothing of theirs."""
        self._window.clear()

    def steps_per_s(self) -> float | None:
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        return (s1 - s0) / (t1 - t0) if len(self._window) > 1 and t1 > t0 and s1 > s0 else None

    def text(self) -> str:
        note = self.latest
        if note is None:
            return ""
        step, rate = note["step"], self.steps_per_s()
        done = f" ({step / self.total_steps:.0%})" if self.total_steps else ""
        parts = [
            f"step {step:,}/{self.total_steps:,}{done}",
            f"epoch {note['epoch']:.2f}/{self.epochs}",
            f"loss {note['loss']:.4f}",
        ]
        if rate is not None:
            parts.append(f"{rate * self.rows_per_step:,.0f} samples/s")
        if "tokens_per_s" in note:
            parts.append(f"{note['tokens_per_s']:,.0f} tokens/s")
        parts.append(f"{duration(time.monotonic() - self.started)} elapsed")
        left = max(self.total_steps - step, 0)
        parts.append(f"ETA {duration(left / rate)}" if rate else "ETA …")
        return "  ".join(parts)

    def renderable(self) -> RenderableType:
        """For a terminal: a bar over the run's steps, then the line."""
        step = 0 if self.latest is None else self.latest["step"]
        row = Table.grid(padding=(0, 1))
        row.add_row(ProgressBar(total=max(self.total_steps, 1), completed=step, width=24), Text(self.text()))
        return row


def duration(seconds: float) -> str:
    """`2h 05m`, `6m 50s`, `42s`."""
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"
