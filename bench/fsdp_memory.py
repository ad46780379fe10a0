"""What each worker holds under DDP and under FSDP2: chat_sft's full fine-tuning of a Llama with random
weights (examples/tiny_chat.py's data and tokenizer, a model as wide and deep as asked), one epoch per
side, each a run of the service (`raytrain-ddp train chat_sft`) in a fresh process. Reported per
side, from the run's last report: `model_state_mb` (the parameters, gradients and AdamW state the
most loaded worker holds, counted tensor by tensor), `peak_memory_mb` (the workers' peak RSS on CPU,
peak allocated on GPU), tokens/s and the validation loss (the same global batch on every side, so
DDP and FSDP2 on as many workers train the same weights).

    .venv/bin/python bench/fsdp_memory.py                        # 2 cores: 4 sides, ~4 min
    .venv/bin/python bench/fsdp_memory.py --hidden 1024 --layers 16 --use-gpu --sides ddp:8 fsdp:8

Writes bench/results/<machine>-fsdp-memory.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 16  # conversations an optimizer step, on every side


def write_data(directory: Path, hidden: int, layers: int) -> Path:
    """examples/tiny_chat.py's conversations and tokenizer, and a Llama of `hidden` x `layers`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("tiny_chat", REPO / "examples" / "tiny_chat.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    chat = tiny.write(directory)
    small = LlamaConfig.from_pretrained(chat / "model")
    config = LlamaConfig(
        **{k: getattr(small, k) for k in ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")},
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(chat / "model")
    return chat


def run_side(chat: Path, strategy: str, workers: int, args: argparse.Namespace, root: Path) -> dict:
    resources = f"{{CPU: {args.cpus / workers:g}{', GPU: 1' if args.use_gpu else ''}}}"
    batch_size = min(8, GLOBAL_BATCH // workers)  # rows a worker's micro-batch: the same global batch
    command = [
        str(REPO / ".venv" / "bin" / "raytrain-ddp"),
        "train",
        "chat_sft",
        "--config",
        str(chat / "chat_sft.yaml"),
        "model.lora_r=0",
        "train.epochs=1",
        f"train.batch_size={batch_size}",
        f"train.grad_accum_steps={GLOBAL_BATCH // (batch_size * workers)}",
        f"scaling.num_workers={workers}",
        f"scaling.strategy={strategy}",
        f"scaling.use_gpu={str(args.use_gpu).lower()}",
        f"scaling.resources_per_worker={resources}",
        f"run.storage_path={root / 'runs'}",
        f"run.name={strategy}-{workers}",
        f"mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}",
        "mlflow.register=never",
        *(["train.precision=bf16"] if args.use_gpu else []),
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{strategy} on {workers}: exit {done.returncode}\n{done.stderr[-3000:]}")
    metrics = json.loads((root / "runs" / f"{strategy}-{workers}" / "epoch_0001" / "metrics.json").read_text())
    return {
        "strategy": strategy,
        "workers": workers,
        "model_state_mb": metrics["model_state_mb"],
        "peak_memory_mb": metrics["peak_memory_mb"],
        "tokens_per_s": metrics["tokens_per_s"],
        "val_loss": metrics["val_loss"],
        "wall_s": time.monotonic() - started,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sides", nargs="+", default=["ddp:1", "ddp:2", "fsdp:2", "fsdp:4"])
    parser.add_argument("--cpus", type=float, default=1.0, help="CPUs shared by each side's workers")
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--machine", default="gpu" if torch.cuda.is_available() else "cpu-2core")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        chat = write_data(root / "chat", args.hidden, args.layers)
        from transformers import LlamaForCausalLM

        parameters = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(chat / "model").parameters())
        rows = []
        for side in args.sides:
            strategy, workers = side.split(":")
            rows.append(run_side(chat, strategy, int(workers), args, root))
            print(json.dumps(rows[-1]), flush=True)
    whole = next((r["model_state_mb"] for r in rows if r["strategy"] == "ddp"), None)
    cpu = _cpu_name()
    lines = [
        f"# Memory a worker holds, DDP and FSDP2: chat_sft full fine-tuning, {args.machine}",
        "",
        f"`{' '.join(['.venv/bin/python bench/fsdp_memory.py', *sys.argv[1:]])}`: {cpu}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__.split('+')[0]}. A Llama with random weights, hidden {args.hidden}, {args.layers} "
        f"layers, vocabulary 512 ({parameters / 1e6:.1f}M parameters, every one trained, AdamW), "
        f"examples/tiny_chat.py's 240 conversations, one epoch, a global batch of {GLOBAL_BATCH} conversations.",
        "",
        "| strategy | workers | parameters + gradients + AdamW state a worker, MB | of DDP's "
        "| peak memory a worker, MB | tokens/s | val loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = f"{r['model_state_mb'] / whole:.2f}" if whole else "-"
        lines.append(
            f"| {r['strategy']} | {r['workers']} | {r['model_state_mb']:,.1f} | {share} | {r['peak_memory_mb']:,.0f} "
            f"| {r['tokens_per_s']:,.0f} | {r['val_loss']:.4f} |"
        )
    out = REPO / "bench" / "results" / f"{args.machine}-fsdp-memory"
    out.with_suffix(".json").write_text(json.dumps({"parameters": parameters, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
