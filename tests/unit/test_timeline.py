"""A run's timeline starts at its command's launch, to a clock tick: the first phase (`config`) is
the command's own start, not up to a second of the boot time's rounding more."""

from __future__ import annotations

import subprocess
import sys
import time

PRINT_LAUNCH = "from raytrain_ddp.driver.timeline import Timeline; print(repr(Timeline().marks[0][1]))"


def test_a_commands_timeline_starts_when_it_was_launched():
    before = time.time()
    child = subprocess.run([sys.executable, "-c", PRINT_LAUNCH], capture_output=True, text=True, check=True)
    after = time.time()
    launched = float(child.stdout)
    # Between the two, give or take a clock tick (10 ms), not up to a second before them.
    assert before - 0.02 <= launched <= after, (launched - before, after - before)
