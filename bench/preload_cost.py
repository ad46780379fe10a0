"""What the driver's preparation for registration costs a DDP run on the same cores, by how the
preparing thread is scheduled (`model_logging.Rehearsal`: a one-layer model logged to a
temporary directory, which loads torch.export and MLflow's model logging, 3-4 CPU-seconds on a small
machine, while the last epoch trains):

    .venv/bin/python bench/preload_cost.py [--rounds 2] [--policies normal,nice,idle]

Side A of the benchmark (torchrun, 2 ranks, the MLP) trains; once its steps are steady, a process of
this session (as the driver is, with the Ray it starts) does that preparation under one policy:
`normal`, `nice` (nice 19) or `idle` (SCHED_IDLE, what raytrain_ddp does). Printed: A's median step
while the preparation ran against its median step before it, and how long the preparation took.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import _free_port, _read_traces  # this folder's benchmark: its probe's files

BENCH = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent

PREPARE = """
import os, sys, threading, time
import mlflow, torch  # as in the driver by then
from raytrain_ddp.registry import tracking
from raytrain_ddp.registry import model_logging
policy = sys.argv[1]
print("ready", flush=True)
sys.stdin.readline()
if policy == "nice":
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
elif policy == "idle":
    model_logging.yield_the_cpu()
started = time.time()
model_logging.rehearse_model_logging()
print(started, time.time(), flush=True)
"""


def steps(trace: Path) -> list[tuple[float, float]]:
    """(start, gap) of every training step of every rank, within an epoch (no evaluation between)."""
    out = [(a, b - a) for times in _read_traces(trace).values() for a, b in zip(times, times[1:])]
    median = statistics.median(gap for _, gap in out)
    return [(t, gap) for t, gap in out if gap < 5 * median]  # not across an epoch's end


def one(policy: str, work: Path) -> tuple[float, float, float]:
    trace = work / "trace"
    prepare = subprocess.Popen(
        [sys.executable, "-c", PREPARE, policy], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert prepare.stdout.readline().strip() == "ready"  # torch imported before A starts
    a = subprocess.Popen(
        [BIN / "torchrun", "--nproc-per-node=2", f"--master-port={_free_port()}", BENCH / "torchrun_ddp.py",
         BENCH / "workload.yaml", "--out", work, f"model.trace={trace}", "train.epochs=4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    while sum(len(p.read_text().splitlines()) for p in trace.glob("rank*.txt")) < 1_200:  # epoch 2 under way
        time.sleep(0.2)
    prepare.stdin.write("go\n")
    prepare.stdin.flush()
    started, ended = map(float, prepare.stdout.readline().split())
    prepare.wait()
    assert a.wait() == 0, "torchrun failed"
    gaps = steps(trace)
    during = [gap for t, gap in gaps if started <= t <= ended]
    before = [gap for t, gap in gaps if t < started]
    return statistics.median(during) / statistics.median(before), ended - started, len(during)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policies", default="normal,nice,idle")
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {}
    for round_ in range(args.rounds):
        for policy in args.policies.split(","):
            with tempfile.TemporaryDirectory() as work:
                ratio, took, n = one(policy, Path(work))
            results.setdefault(policy, []).append((ratio, took, n))
            print(f"round {round_ + 1} {policy:6}: step while preparing / before {ratio:.3f}, "
                  f"preparing took {took:.1f} s ({n} steps)", flush=True)  # fmt: skip
    print("\n| policy | A's step while preparing / before | preparing took, s |\n|---|---|---|")
    for policy, rows in results.items():
        ratios = ", ".join(f"{r:.2f}" for r, _, _ in rows)
        print(f"| {policy} | {ratios} | {', '.join(f'{t:.1f}' for _, t, _ in rows)} |")


if __name__ == "__main__":
    main()
