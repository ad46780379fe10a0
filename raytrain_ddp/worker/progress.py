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

import logging
import threading
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)
PROGRESS = "progress"  # the queue's event: ("progress", {time, step, epoch, loss[, tokens_per_s]})


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
