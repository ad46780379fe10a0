"""What the live progress costs rank 0, measured piece by piece (the harness's B vs B-quiet measures
the whole, within its noise):

    .venv/bin/python bench/progress_cost.py [--step-ms 12.4] [--every-s 2]

- on the training thread, per optimizer step: `Beacon.note` (one tuple, one assignment);
- on the sending thread, per send (one every run.progress_s): reading the loss, building the note and
  `put_nowait.remote` to a real Ray queue actor, which holds the GIL for part of it.
Their sum per step, against a steady step of `--step-ms` (the benchmark's B on 2 cores: ~12 ms), is
the share of a step the display can take at most.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch
from ray.util.queue import Queue

from raytrain_ddp.worker.progress import Beacon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=12.4, help="the steady step to compare with, ms")
    parser.add_argument("--every-s", type=float, default=2.0, help="run.progress_s")
    args = parser.parse_args()

    loss, n = torch.tensor(0.5), 200_000
    beacon = Beacon(None, 0, 2)  # notes only: no thread
    started = time.perf_counter()
    for step in range(n):
        beacon.note(step, step / 1000, loss, 64, None)
    note_us = (time.perf_counter() - started) / n * 1e6

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    queue = Queue(actor_options={"num_cpus": 0})
    sender = Beacon(queue, 0, 2)  # sends by hand below, timed
    sends, before = 500, None
    started = time.perf_counter()
    for step in range(sends):
        sender.note(step, step / 1000, loss, 64, None)
        queue.actor.put_nowait.remote(("progress", sender._payload(sender._note, before)))
        before = sender._note
    send_us = (time.perf_counter() - started) / sends * 1e6
    assert len([queue.get(timeout=30) for _ in range(sends)]) == sends
    ray.shutdown()

    steps_per_send = args.every_s * 1000 / args.step_ms
    per_step_us = note_us + send_us / steps_per_send
    print(f"Beacon.note, per step (training thread): {note_us:.2f} µs")
    print(f"one send (sending thread, every {args.every_s:g} s): {send_us:.0f} µs")
    print(
        f"per step of {args.step_ms:g} ms: {per_step_us:.2f} µs = {per_step_us / (args.step_ms * 1000):.4%} "
        "(at most: the sending thread runs beside the step, not in it)"
    )


if __name__ == "__main__":
    main()
