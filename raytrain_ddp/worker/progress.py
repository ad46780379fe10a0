"""Live progress between reports: the step, the loss, samples/s (tokens/s) and the time left.

A report comes once an epoch (or every checkpoint.every_n_steps): with hour-long epochs the console
would say nothing for an hour. Rank 0 alone notes each optimizer step (`Beacon.note`: one assignment,
no synchronization, no collective), and a thread of its own sends the newest note to the driver's
queue at most every run.progress_s seconds, without waiting for an answer. The driver's `Progress`
turns the notes into what the console shows (console.LiveProgress): a line redrawn in place on a
terminal; on anything else (a log, `ray job logs`, a notebook) a plain line at most every
run.progress_log_s seconds, with no control characters.

    step 1,200/5,000 (24%)  epoch 2.40/10  loss 0.4321  1,234 samples/s  2m 10s elapsed  ETA 6m 50s
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import torch
from rich.console import RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

logger = logging.getLogger(__name__)
PROGRESS = "progress"  # the queue's event: ("progress", {time, step, epoch, loss[, tokens_per_s]})
RATE_WINDOW = 30  # notes the rate (and so the ETA) is measured over: about a minute at 2 s


class Beacon:
    """Rank 0's progress, noted by the training loop at each optimizer step and sent to the driver
    from a daemon thread. Elsewhere (other ranks, run.progress_s=0) `note` is all there is."""

    def __init__(self, queue: Any, every_s: float, world_size: int):
        self._note: tuple | None = None
        self.queue, self.every_s, self.world_size = queue, every_s, world_size
        if queue is not None and every_s > 0:
            threading.Thread(target=self._send, daemon=True, name="raytrain_ddp-progress").start()

    def note(self, step: int, epoch: float, loss: torch.Tensor, count: torch.Tensor | int, tokens: int | None) -> None:
        """Where training stands after optimizer step `step`: `loss` summed over `count` (the step's
        last micro-batch, detached: read on the sending thread, never here), and the epoch's tokens
        so far (None: the recipe counts none)."""
        self._note = (time.time(), step, epoch, loss, count, tokens)

    def _send(self) -> None:
        sent = None
        while True:
            time.sleep(self.every_s)
            note = self._note
            if note is None or note is sent:
                continue
            try:  # never the run's problem: a lost line at most
                self.queue.actor.put_nowait.remote((PROGRESS, self._payload(note, sent)))
            except Exception as e:  # noqa: BLE001
                logger.debug("progress not sent: %s", e)
            sent = note

    def _payload(self, note: tuple, before: tuple | None) -> dict[str, Any]:
        at, step, epoch, loss, count, tokens = note
        payload = {"time": at, "step": step, "epoch": epoch, "loss": float(loss) / max(float(count), 1.0)}
        if tokens is not None and before is not None and before[5] is not None and tokens >= before[5] > 0:
            payload["tokens_per_s"] = (tokens - before[5]) * self.world_size / max(at - before[0], 1e-9)
        return payload


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
