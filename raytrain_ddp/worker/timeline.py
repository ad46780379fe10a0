"""Rank 0's phases of a run (`WorkerMarks`), sent with its next report under `MARKS`; the driver lays
them out with its own and the controller's (`driver/timeline.py`)."""

from __future__ import annotations

import time
from typing import Any

MARKS = "timeline"  # in a report: {phase: wall time} of rank 0 since its previous report


class WorkerMarks:
    """Rank 0's phases, sent with its next report (`pop`); other ranks keep none."""

    def __init__(self, rank: int):
        self.keep = rank == 0
        self.pending: dict[str, float] = {}
        self.seen: set[str] = set()

    def mark(self, phase: str) -> None:
        if self.keep:
            self.pending[phase] = time.time()

    def once(self, phase: str) -> None:
        """Mark `phase` the first time only (the first batch, the first step)."""
        if self.keep and phase not in self.seen:
            self.seen.add(phase)
            self.mark(phase)

    def pop(self) -> dict[str, dict[str, float]]:
        pending, self.pending = self.pending, {}
        return {MARKS: pending} if pending else {}


def strip(metrics: dict[str, Any]) -> dict[str, Any]:
    """A report's metrics without rank 0's marks."""
    return {k: v for k, v in metrics.items() if k != MARKS}
