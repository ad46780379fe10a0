"""Where one GPU's training step goes: a benchmark workload's step, compiled, on one GPU, no DDP.

    python bench/step_profile.py --batch 16,32 --loss outside,inside      # GPT-2 small
    python bench/step_profile.py --arch resnet50 --batch 128,256          # ResNet-50, channels_last

For each variant (GPT-2: the loss computed outside the compiled forward, eager, as the workload did
before, or inside it; each per-GPU batch), it compiles the model as both benchmark sides do
(`torch.compile`, static shapes), bf16 autocast, the benchmark's fused AdamW, then times `--steps`
steps after `--warmup` steps, and profiles three more (torch.profiler): GPU time by kind of kernel
(matrix products and convolutions, attention, the compiler's fused kernels, the optimizer, the rest)
and the ten longest kernels. MFU as the harness counts it: a step's FLOPs per token (GPT-2) or per
image from raytrain_ddp's counter over the device's dense bf16 peak (raytrain_ddp.worker.flops.PEAKS).
Runs on a CPU too, for a quick look (`--layers 1`), without MFU.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import workload  # noqa: E402
from torchrun_ddp import build_optimizer  # noqa: E402  (the benchmark's AdamW, both sides')

from raytrain_ddp.worker.flops import count, peak_flops  # noqa: E402

SEQUENCE = 1024
KINDS = [  # first match wins: a kernel's name -> its kind
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("matrix products", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|cublas|conv|cudnn", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("fused (inductor)", re.compile(r"^triton_", re.I)),
    ("loss, eager", re.compile(r"softmax|nll|cross_entropy", re.I)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["gpt2", "resnet50"], default="gpt2")
    parser.add_argument("--batch", default="16", help="rows per step, comma-separated")
    parser.add_argument("--loss", default="outside,inside", help="GPT-2: where its loss is computed, comma-separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--layers", type=int, default=12, help="GPT-2: fewer for a quick look on a CPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    peak = peak_flops(name, "bf16") if cuda else None
    meta = torch.device("meta")
    with meta:
        flops = count(_losses(args.arch)["inside"], _model(args), _data(args.arch, 2, meta), tokens=None)
    unit, per_unit = ("token", flops.per_sample / SEQUENCE) if args.arch == "gpt2" else ("image", flops.per_sample)
    print(f"{name}, torch {torch.__version__}: {per_unit / 1e9:.3f} GFLOP per {unit}")

    for loss in args.loss.split(",") if args.arch == "gpt2" else ["outside"]:
        for batch in (int(b) for b in args.batch.split(",")):
            _variant(loss, batch, args, device, unit, per_unit, peak)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()


def _model(args: argparse.Namespace) -> torch.nn.Module:
    if args.arch == "gpt2":
        return workload.Decoder(layers=args.layers)
    return workload.build_model(arch="resnet50", classes=1000)


def _data(arch: str, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    if arch == "gpt2":
        return {"tokens": torch.randint(0, 50304, (rows, SEQUENCE + 1), device=device)}
    images = torch.randint(0, 256, (rows, 3, 224, 224), dtype=torch.uint8, device=device)
    return {"image": images, "label": torch.randint(0, 1000, (rows,), device=device)}


def _losses(arch: str) -> dict:
    """Where the loss is computed -> a compute_loss (ResNet-50's is the workload's, after the forward)."""
    if arch == "gpt2":
        return {"inside": _loss_inside, "outside": _loss_outside}
    return {"inside": workload.compute_loss, "outside": workload.compute_loss}


def _variant(loss: str, batch: int, args: argparse.Namespace, device: torch.device, unit: str, per_unit, peak) -> None:
    cuda = device.type == "cuda"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _model(args).to(device)
    compiled = torch.compile(model, dynamic=False)
    optimizer = build_optimizer(model, {"optimizer": "adamw", "lr": 6e-4, "weight_decay": 0.0})
    data = _data(args.arch, batch, device)
    step_loss = _losses(args.arch)[loss]

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            value = step_loss(compiled, data)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first = _timed(step, 1, cuda)
    _timed(step, args.warmup, cuda)
    ms = 1e3 * _timed(step, args.steps, cuda) / args.steps
    per_s = batch * (SEQUENCE if unit == "token" else 1) / (ms / 1e3)
    mfu = f"MFU {100 * per_s * per_unit / peak:.1f} %" if peak else "no MFU (no GPU peak)"
    memory = f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
    variant = f"loss {loss}, batch {batch}" if args.arch == "gpt2" else f"batch {batch}"
    print(
        f"\n{args.arch}, {variant}: {ms:.2f} ms/step, {per_s:,.0f} {unit}s/s, {mfu}; "
        f"first step (compile) {first:.1f} s; {memory}"
    )
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        _timed(step, 3, cuda)
    _print_kernels(prof, "CUDA" if cuda else "CPU", steps=3, step_ms=ms)


def _timed(step, steps: int, cuda: bool) -> float:
    """Seconds for `steps` steps, the device's queue drained at both ends."""
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _loss_inside(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["tokens"][:, :-1], batch["tokens"][:, 1:])


def _loss_outside(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["tokens"][:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["tokens"][:, 1:].flatten())


def _print_kernels(prof: profile, device: str, steps: int, step_ms: float) -> None:
    by_kind: dict[str, float] = defaultdict(float)
    kernels = [e for e in prof.key_averages() if e.device_type.name == device and e.self_device_time_total > 0]
    for e in kernels:
        kind = next((k for k, pattern in KINDS if pattern.search(e.key)), "other")
        by_kind[kind] += e.self_device_time_total / 1e3 / steps  # ms per step
    if not kernels:  # a profiler that names devices otherwise: its own table
        print(prof.key_averages().table(row_limit=15))
        return
    busy = sum(by_kind.values())
    print(f"  {device} busy {busy:.2f} ms of a {step_ms:.2f} ms step:")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:<18} {ms:7.2f} ms  {100 * ms / busy:5.1f} %")
    print("  longest kernels (ms per step, calls per step):")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"    {e.self_device_time_total / 1e3 / steps:7.2f}  {e.count // steps:4d}  {e.key[:110]}")


if __name__ == "__main__":
    main()
