"""What chat_sft's chunked loss saves: the peak memory and time of one training step (forward,
loss, backward) with the loss taken from every position's logits at once (as the recipe did before)
against the recipe's `compute_loss` (the trained positions' logits, a chunk at a time, recomputed in
the backward pass). Each side in a fresh process, one after the other, several rounds.

    .venv/bin/python bench/loss_memory.py                   # SmolLM2-135M's width and vocabulary, 4 layers
    .venv/bin/python bench/loss_memory.py --layers 30 --rows 16 --length 1024   # on a GPU: the whole model

The peak is the process's peak RSS above its RSS before the step (CPU), or the most the step's
tensors held (`max_memory_allocated`, GPU). The model has random weights and trains every weight
(every weight trains: the output layer's gradient is part of the peak); half of each row's
positions are trained, as in chat data where prompts are not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
IGNORE = -100


def at_once(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every position's logits, then the loss of the trained ones."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def chunked(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    spec = importlib.util.spec_from_file_location("chat_sft", REPO / "jobs" / "chat_sft.py")
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    return sft.compute_loss(model, batch)[0]


def one_step(side: str, args: argparse.Namespace) -> dict:
    """Runs in its own process: builds the model and a batch, then times one step and its peak."""
    import psutil
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocabulary,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 192),
        max_position_embeddings=args.length,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(device).train()
    ids = torch.randint(0, args.vocabulary, (args.rows, args.length), device=device)
    labels = ids.clone()
    labels[:, : args.length // 2] = IGNORE  # the prompt half
    batch = {"input_ids": ids, "labels": labels, "length": torch.full((args.rows,), args.length, device=device)}
    loss_of = {"at-once": at_once, "chunked": chunked}[side]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    loss = loss_of(model, batch)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"side": side, "loss": float(loss), "step_s": time.perf_counter() - started, "peak_mb": peak / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabulary", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", help=argparse.SUPPRESS)  # set in the process that measures one side
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_step(args.side, args)))
        return 0
    runs = []
    for round_ in range(args.rounds):
        for side in ("at-once", "chunked") if round_ % 2 == 0 else ("chunked", "at-once"):
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--side", side], capture_output=True, text=True, check=True
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    print(
        f"\n{args.rows} rows x {args.length} tokens, vocabulary {args.vocabulary:,}, hidden {args.hidden}, "
        f"{args.layers} layers; median [min-max] of {args.rounds} rounds\n"
    )
    print("| loss | peak memory of the step, MB | step, s |\n|---|---|---|")
    for side in ("at-once", "chunked"):
        peaks, steps = (
            [r["peak_mb"] for r in runs if r["side"] == side],
            [r["step_s"] for r in runs if r["side"] == side],
        )
        print(
            f"| {side} | {statistics.median(peaks):,.0f} [{min(peaks):,.0f}-{max(peaks):,.0f}] | "
            f"{statistics.median(steps):.2f} [{min(steps):.2f}-{max(steps):.2f}] |"
        )
    losses = {r["loss"] for r in runs}
    print(f"\nthe loss, every run: {', '.join(f'{x:.4f}' for x in sorted(losses))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
