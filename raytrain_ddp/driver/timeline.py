"""Where the wall time of a run goes: the phases of one run, from the process's launch to its end.

Three places keep the clock, all in wall time (`time.time()`, comparable across the processes of a
machine): the driver marks its own phases (`mark`); Ray Train's controller marks the worker group's
(`callbacks.ControllerMarks`, a controller callback, through the progress display's queue); rank 0 marks the
worker's (`WorkerMarks`) and sends them with its next report, under `MARKS`. `Timeline.table()` lays
them out as phases, each from its mark to the next; `driver.run` keeps the run's in
`<run>/timeline.json` and the benchmark prints it. One `Timeline` per run, passed down from where
the run starts (the command line's, from its launch).

Each mark names the end of a phase: "datasets" is the moment the datasets were built, so the phase
"datasets" is the time between the mark before it and this one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import psutil

from raytrain_ddp.worker.timeline import MARKS, WorkerMarks, strip  # noqa: F401 - the run's whole timeline here

logger = logging.getLogger(__name__)


# The phases, in the order they happen (a resumed or restarted run repeats the worker group's).
DRIVER_START = ("config", "imports", "checks", "ray", "datasets", "example rows", "pre-flight", "mlflow")
WORKER_START = ("controller", "placement", "worker group", "train context", "loop", "model", "first batch")
FIRST_STEP = "first step"
TEARDOWN = ("last step", "workers done", "worker group stopped", "fit returned", "registered")


class Timeline:
    """The marks of one run, in the order of their times."""

    def __init__(self, launched: float | None = None):
        """From `launched` (wall time), else from this process's launch: a command's run counts its
        imports and config; a notebook's run starts its own clock (`Timeline(time.time())`)."""
        self.marks: list[tuple[str, float]] = [("launch", launched if launched is not None else _process_start())]

    def mark(self, phase: str, at: float | None = None) -> None:
        self.marks.append((phase, time.time() if at is None else at))

    def add(self, marks: dict[str, float]) -> None:
        for phase, at in marks.items():
            self.mark(phase, at)

    def phases(self) -> list[tuple[str, float, float]]:
        """(phase, its end since launch, its length), in time order, seconds."""
        ordered = sorted(self.marks, key=lambda m: m[1])
        launched = ordered[0][1]
        return [(phase, at - launched, at - before) for (_, before), (phase, at) in zip(ordered, ordered[1:])]

    def to_json(self) -> str:
        return json.dumps({"marks": self.marks, "phases": self.phases()}, indent=1)

    def table(self) -> str:
        rows = [f"  {phase:<22} {length:7.2f} s   (at {end:6.2f} s)" for phase, end, length in self.phases()]
        return "\n".join(["timeline (phase: its length, and when it ended, from launch)", *rows])


def _process_start() -> float:
    """When this process was launched, to a clock tick: the driver's imports count. On Linux, its
    start in ticks since boot (/proc/self/stat) on the clock of the time since boot; psutil adds
    them to the boot time /proc/stat gives in whole seconds, up to a second early (0.9 s on one host)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22, starttime
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME: not Linux
        with contextlib.suppress(psutil.Error):
            return psutil.Process().create_time()
        return time.time()
