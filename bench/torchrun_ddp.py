"""Side A: the benchmark's workload as a plain PyTorch DDP script, the way one is written without Ray.

    torchrun --nproc-per-node 2 bench/torchrun_ddp.py bench/workload.yaml --out DIR [key=value ...]

It reads the same YAML as side B (seed, model, dataset, train.epochs, batch_size, lr, weight_decay,
precision, compile) and imports the same recipe (bench/workload.py): same model, same data in memory,
same seed, same per-worker batch, same optimizer built the same way (`build_optimizer`), compiled the
same way with train.compile (`torch.compile` of the module DDP wraps, static shapes). Gloo on CPU, NCCL
on GPU (one GPU per process).
Each epoch ends with a checkpoint, as a plain script would write one: rank 0 saves the model and
optimizer with torch.save. Rank 0 writes the final weights to DIR/final.pt and every rank its clocks
to DIR/rank<R>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

RECIPE = Path(__file__).with_name("workload.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml", metavar="YAML", help="the benchmark's YAML (bench/workload.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="the same overrides side B is given")
    parser.add_argument(
        "--config", dest="layer", metavar="FILE", help="a YAML layered over it (as raytrain-ddp train --config)"
    )
    parser.add_argument("--out", required=True, help="directory for final.pt, rank<R>.json and the checkpoints")
    args = parser.parse_intermixed_args()
    config = load(args.yaml, args.overrides, args.layer)
    recipe = _import(RECIPE)
    train, out = config["train"], Path(args.out)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(config["seed"])
    model = recipe.build_model(**config["model"]).to(device)
    # As raytrain_ddp.worker.loop.wrap_model: the model compiled inside DDP, so DDP's buckets split the graph;
    # and as Ray's prepare_model there, no DDP for a single process (on one GPU, DDP around a compiled
    # model only slows its step).
    trained = torch.compile(model, dynamic=False) if train.get("compile") else model
    ddp_model = DistributedDataParallel(trained, device_ids=[device.index] if cuda else None) if world > 1 else trained
    optimizer = build_optimizer(model, train)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=train.get("precision") == "bf16")

    dataset = config["dataset"]
    rows = recipe.build_datasets(seed=config["seed"], **{**dataset, "source": "torch"})["train"]
    mine = recipe.rank_rows(dataset["rows"], rank, world).tolist()
    loader = DataLoader(rows, batch_size=train["batch_size"], sampler=mine, pin_memory=cuda)
    batches = math.ceil(len(mine) / train["batch_size"])

    clocks = []
    for epoch in range(train["epochs"]):
        started, data_wait, compute = time.perf_counter(), 0.0, 0.0
        ddp_model.train()
        batch_iter = iter(loader)
        for _ in range(batches):
            waiting = time.perf_counter()
            batch = {k: v.to(device, non_blocking=True) for k, v in next(batch_iter).items()}
            computing = time.perf_counter()
            with autocast:
                loss = recipe.compute_loss(ddp_model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            data_wait += computing - waiting
            compute += time.perf_counter() - computing
        saving = time.perf_counter()
        if rank == 0:
            (out / "checkpoints").mkdir(parents=True, exist_ok=True)
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1},
                out / "checkpoints" / f"epoch_{epoch + 1:04d}.pt",
            )
        dist.barrier()
        clocks.append(
            {
                "epoch": epoch + 1,
                "data_wait_s": data_wait,
                "compute_s": compute,
                "epoch_time_s": saving - started,
                "checkpoint_s": time.perf_counter() - saving,
            }
        )

    if rank == 0:
        torch.save(model.state_dict(), out / "final.pt")
    (out / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "world": world, "device": str(device), "epochs": clocks})
    )
    dist.destroy_process_group()


def build_optimizer(model: torch.nn.Module, train: dict) -> torch.optim.Optimizer:
    """raytrain_ddp.worker.optim.build_optimizer for the workload's AdamW, mirrored: weight decay on matrices
    only, in two parameter groups; fused kernels, which torch has on CPU and CUDA."""
    if train["optimizer"] != "adamw":
        raise SystemExit(f"train.optimizer={train['optimizer']}: side A mirrors the service's AdamW only")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train["weight_decay"]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train["lr"], fused=True)


def load(path: str, overrides: list[str], layer: str | None = None) -> dict:
    """The YAML, a YAML layered over it, then `key.sub=value` overrides (values parsed as YAML)."""
    config = yaml.safe_load(Path(path).read_text())
    if layer:
        config = _merge(config, yaml.safe_load(Path(layer).read_text()))
    for override in overrides:
        key, _, value = override.partition("=")
        *parents, leaf = key.split(".")
        section = config
        for parent in parents:
            section = section.setdefault(parent, {})
        section[leaf] = yaml.safe_load(value)
    return config


def _merge(base: dict, top: dict) -> dict:
    return {
        **base,
        **{
            k: _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
            for k, v in top.items()
        },
    }


def _import(path: Path):
    spec = importlib.util.spec_from_file_location("bench_workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
