"""The driver loads what registering the model takes (torch.export's imports, 3-4 CPU-seconds on a
small machine) on a thread while the last epoch trains, under SCHED_IDLE: it takes the CPU time the
training workers leave and yields the moment one wakes (`bench/preload_cost.py` measures what each
policy costs a DDP run on the same cores). Only that thread: the driver's others keep their own."""

from __future__ import annotations

import os
import threading

from raytrain_ddp import tracking


def test_a_thread_that_yields_the_cpu_runs_under_sched_idle_and_the_callers_thread_does_not():
    seen = {}

    def prepare() -> None:
        tracking.yield_the_cpu()
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())

    thread = threading.Thread(target=prepare)
    thread.start()
    thread.join()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
