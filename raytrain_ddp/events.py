"""The run's events on their way to the driver: what Ray Train's controller sees (reports, failures,
the worker group's phases: `callbacks.py`) and rank 0's live progress (`progress.Beacon`), drained by
the driver's display (`console.LiveProgress`) while `fit()` runs.

Through the key-value store of Ray's GCS, which every Ray process already talks to: a Ray queue is
an actor, one more process a run (~0.75 CPU-seconds to start, on the cores the run's start needs on a
small machine) and one more process a run can lose. Each event is a key of its own under the run's
prefix, named by the process that put it and its count there; the driver lists the prefix, reads the
events in each process's order (the processes' merged by the time each event was put) and deletes
them. Ray's store has no public API of its own: `ray.experimental.internal_kv`, what Ray's own
libraries use, is the one place this module touches it.
"""

from __future__ import annotations

import heapq
import itertools
import pickle
import time
import uuid
from typing import Any

from ray.experimental import internal_kv as kv

NAMESPACE = "raytrain_ddp"
_PROCESS = uuid.uuid4().hex  # this process, among those that put events: a key's first part
_COUNT = itertools.count()  # the events this process has put: a key's second part, in order


class Channel:
    """Events of one run (tuples, pickled), from any Ray process to the driver that made it. Put never
    blocks for long (one request to the GCS); `take` returns, and removes, every event put so far."""

    def __init__(self) -> None:
        self.prefix = f"events/{uuid.uuid4().hex}/"

    def put(self, event: tuple) -> None:
        key = f"{self.prefix}{_PROCESS}/{next(_COUNT):012d}"
        kv._internal_kv_put(key, pickle.dumps((time.time(), event)), namespace=NAMESPACE)

    def take(self) -> list[tuple]:
        by_process: dict[str, list[tuple[float, Any]]] = {}
        for key in sorted(kv._internal_kv_list(self.prefix, namespace=NAMESPACE)):
            value = kv._internal_kv_get(key, namespace=NAMESPACE)
            kv._internal_kv_del(key, namespace=NAMESPACE)
            if value is not None:
                by_process.setdefault(key.decode().rsplit("/", 2)[1], []).append(pickle.loads(value))
        # Each process's in its order, however the clocks of the nodes differ; theirs by the time put.
        return [event for _, event in heapq.merge(*by_process.values(), key=lambda timed: timed[0])]

    def close(self) -> None:
        """Remove what is left (a rank's progress put as the run ended)."""
        kv._internal_kv_del(self.prefix, del_by_prefix=True, namespace=NAMESPACE)
