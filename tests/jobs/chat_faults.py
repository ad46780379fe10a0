"""chat_sft (jobs/chat_sft.py) with a fault for the reliability test: rank `model.kill_rank` SIGKILLs
itself at its `model.kill_at`-th training micro-batch (compute_loss call), counted over all attempts of
the run (each call appends the worker's pid to `model.fault_log`/rank<R>.log). Everything else is
chat_sft's own."""

from __future__ import annotations

import inspect
import os
import signal
from pathlib import Path

from torch import nn

from raytrain_ddp.config import recipe as recipes

SFT = recipes.load(str(Path(__file__).parents[2] / "jobs" / "chat_sft.py"))
build_datasets, evaluate = SFT.build_datasets, SFT.evaluate
derived_metrics, count_tokens, log_model = SFT.derived_metrics, SFT.count_tokens, SFT.log_model


def build_model(*, kill_rank: int, kill_at: int, fault_log: str, **model) -> nn.Module:
    built = SFT.build_model(**model)
    built.fault = (kill_rank, kill_at, fault_log)
    return built


def build_empty_model(*, kill_rank: int, kill_at: int, fault_log: str, **model) -> nn.Module:
    return SFT.build_empty_model(**model)


def compute_loss(model: nn.Module, batch):
    import ray.train

    fault = getattr(getattr(model, "module", model), "fault", None)  # `model` may be the DDP wrapper
    if fault is None:  # the driver's check, on the empty model
        return SFT.compute_loss(model, batch)
    kill_rank, kill_at, fault_log = fault
    rank = ray.train.get_context().get_world_rank()
    if rank == kill_rank:
        log = Path(fault_log) / f"rank{rank}.log"
        with log.open("a") as f:
            f.write(f"{os.getpid()}\n")
        if len(log.read_text().split()) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return SFT.compute_loss(model, batch)


# chat_sft's keywords, and the fault's: what the config of `model:` is checked against.
_faults = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=t) for name, t in
           (("kill_rank", int), ("kill_at", int), ("fault_log", str))]  # fmt: skip
_sft = inspect.signature(SFT.build_model, eval_str=True)
build_model.__signature__ = _sft.replace(parameters=[*_faults, *_sft.parameters.values()])
