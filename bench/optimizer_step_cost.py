"""What the service's optimizer step costs over torchrun's, on the benchmark's model, in one process:

    .venv/bin/python bench/optimizer_step_cost.py [--rounds 9] [--steps 600]

- A: side A's update (bench/torchrun_ddp.py): the fused AdamW's step, then zero_grad;
- B: `raytrain_ddp.worker.step.optimizer_step` without train.grad_clip_norm (the benchmark's setting): the
  same optimizer, the grad scaler passing through, the gradients' global norm (the reported
  `grad_norm`), the LR schedule;
- B, clip at inf: the same, with the norm from `clip_grad_norm_(params, inf)`, as the service did
  until 2026-11-27 (it also multiplied every gradient by 1).
Each timed step first sets the same gradients (a copy, timed alone and subtracted). One thread, as
each rank of the 2-core benchmark runs. The median of the rounds, alternating, in ms per step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from torchrun_ddp import build_optimizer
from workload import build_model

from raytrain_ddp.config.schema import TrainSettings
from raytrain_ddp.worker.optim import Updater
from raytrain_ddp.worker.step import optimizer_step

WORKLOAD = yaml.safe_load((Path(__file__).parent / "workload.yaml").read_text())


def clipped_at_inf(updater: Updater) -> None:
    """The service's optimizer step as it was: the norm from clip_grad_norm_ with no bound."""
    optimizer, scaler = updater.optimizer, updater.scaler
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(updater.parameters, math.inf)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    updater.scheduler.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=600, help="timed steps per side and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train = WORKLOAD["train"]
    settings = TrainSettings(**{k: train[k] for k in ("epochs", "batch_size", "optimizer", "lr", "weight_decay")})
    models = [build_model(hidden=WORKLOAD["model"]["hidden"]) for _ in range(4)]
    gradients = [torch.randn_like(p) * 1e-3 for p in models[0].parameters()]
    plain = build_optimizer(models[0], train)
    service, before = (Updater(m, settings, 480, torch.device("cpu")) for m in models[1:3])

    def with_gradients(model: torch.nn.Module, update: Callable[[], object]) -> Callable[[], None]:
        def step() -> None:
            for p, g in zip(model.parameters(), gradients):
                p.grad = g.clone()
            update()

        return step

    def torchruns() -> None:
        plain.step()
        plain.zero_grad(set_to_none=True)

    sides = {
        "copying the gradients": with_gradients(models[3], lambda: None),
        "A: AdamW step + zero_grad": with_gradients(models[0], torchruns),
        "B: optimizer_step": with_gradients(models[1], lambda: optimizer_step(service, None)),
        "B, clip at inf (before)": with_gradients(models[2], lambda: clipped_at_inf(before)),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, step in sides.items():
            for _ in range(30):
                step()
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - started) / args.steps * 1e3)

    copy = statistics.median(times.pop("copying the gradients"))
    base = statistics.median(times["A: AdamW step + zero_grad"]) - copy
    params = sum(p.numel() for p in models[0].parameters())
    print(f"{WORKLOAD['model']['arch']}, {params:,} parameters, 1 thread, median of {args.rounds} rounds:")
    for name, values in times.items():
        ms = statistics.median(values) - copy
        print(f"  {name:26s} {ms:.3f} ms a step  ({ms - base:+.3f} ms vs A)")


if __name__ == "__main__":
    main()
