"""chat_sft against TRL's SFTTrainer: the same model, conversations, hyper-parameters and number of
processes, each side at each of its batch shapes (padded, grouped by length, packed), alternating
in every round; each round its own seed, after a warm-up run of each side's runner that is not
counted (the first runs of a session read both environments' files from disk: without it the first
round was the slowest on every side).

    make bench-trl                                   # warm-up, 3 rounds of the six sides (~55 min on 2 cores)
    make bench-trl ARGS="--rounds 1 --no-warmup --sides S,T"   # a quick look

Side S is `raytrain-ddp train chat_sft`; side T is TRL's SFTTrainer under torchrun
(bench/trl_sft.py), in a second environment that adds TRL to .venv's (the Makefile's bench-trl).
Figures per side: tokens/s (the conversations' tokens, not padding, over the epochs' training
time: the service's busy time, TRL's epoch begin -> end), the slowest epoch, the peak RSS of a
worker process, and the validation loss after the last epoch, by chat_sft's `evaluate` on both sides.
Written to bench/results/<machine>-chat-sft-vs-trl.{json,md}.

The workload: a Llama-shaped model with random weights and a BPE tokenizer trained on the
conversations (examples/tiny_chat.py's builders, larger), whose chat template marks the assistant's
turns with {% generation %} so both sides train exactly the same tokens; conversations of one to
sixteen exchanges, from tens to hundreds of tokens, as mixed as real chat data.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))

SIDES = {  # side -> (runner, its arguments)
    "S": ("service", []),
    "S-grouped": ("service", ["train.group_by_length=length"]),
    "S-packed": ("service", ["dataset.packing=bfd"]),
    "T": ("trl", []),
    "T-grouped": ("trl", ["--group-by-length"]),
    "T-packed": ("trl", ["--packing", "bfd"]),
}
# Both sides' settings: LoRA on every linear layer, AdamW, cosine schedule, clipping at 1.
HYPER = {"epochs": 2, "batch_size": 8, "max_length": 640, "lr": 2e-3, "warmup_steps": 5, "lora_r": 16, "lora_alpha": 32}
TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def conversations(n: int, seed: int) -> list[dict]:
    """Tiny chat's exchanges, one to sixteen of them (most short, a long tail), some after a system message."""
    import tiny_chat

    rng, known = random.Random(seed), tiny_chat.facts()
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": tiny_chat.SYSTEM}] if rng.random() < 0.5 else []
        for _ in range(rng.choice([1, 1, 2, 2, 3, 4, 6, 8, 12, 16])):
            question, answer = tiny_chat.exchange(rng, known)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows


def write_workload(directory: Path, train: int, val: int, hidden: int, layers: int) -> dict:
    """The model (random weights) and tokenizer in `model/`, `train.jsonl` and `val.jsonl`; returns
    the workload's description."""
    import tiny_chat
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    train_rows, val_rows = conversations(train, seed=1), conversations(val, seed=2)
    texts = [m["content"] for row in train_rows for m in row["messages"]] + ["user", "assistant", "system"]
    tokenizer = tiny_chat.build_tokenizer(texts, vocab_size=4096)
    tokenizer.chat_template, tokenizer.model_max_length = TEMPLATE, HYPER["max_length"]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=HYPER["max_length"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    tiny_chat.write_jsonl(directory / "train.jsonl", train_rows)
    tiny_chat.write_jsonl(directory / "val.jsonl", val_rows)
    sft = chat_sft()
    lengths = [len(sft.tokenize(row, tokenizer, HYPER["max_length"])[0]) for row in train_rows]
    size = HYPER["batch_size"]
    padded = sum(max(lengths[i : i + size]) * len(lengths[i : i + size]) for i in range(0, len(lengths), size))
    return {
        "model": f"Llama, hidden {hidden}, {layers} layers, vocabulary {len(tokenizer)}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, random weights",
        "train_rows": train,
        "val_rows": val,
        "tokens_per_epoch": sum(lengths),
        "lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
        "padding_share_in_order": 1 - sum(lengths) / padded,
    }


def chat_sft():
    """jobs/chat_sft.py, the recipe, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chat_sft", REPO / "jobs" / "chat_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_side(side: str, seed: int, work: Path, trl_python: str, workers: int) -> dict:
    runner, extra = SIDES[side]
    out = work / f"{seed}-{side}"
    out.mkdir()
    model, train, val = work / "data" / "model", work / "data" / "train.jsonl", work / "data" / "val.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    if runner == "service":
        command = [
            str(REPO / ".venv" / "bin" / "raytrain-ddp"), "train", "chat_sft",
            f"model.path={model}", f"dataset.path={train}", f"dataset.val_path={val}",
            f"dataset.max_length={HYPER['max_length']}", f"seed={seed}",
            f"train.epochs={HYPER['epochs']}", f"train.batch_size={HYPER['batch_size']}", f"train.lr={HYPER['lr']}",
            f"train.warmup_steps={HYPER['warmup_steps']}", "train.grad_clip_norm=1.0", "train.weight_decay=0",
            f"model.lora_r={HYPER['lora_r']}", f"model.lora_alpha={HYPER['lora_alpha']}",
            "model.lora_targets=all-linear",
            f"scaling.num_workers={workers}", f"scaling.resources_per_worker.CPU={1 / workers}",
            f"run.storage_path={out / 'runs'}", f"run.name=bench-{seed}-{side}", "checkpoint.num_to_keep=1",
            f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}", "mlflow.register=never", *extra,
        ]  # fmt: skip
    else:
        command = [
            str(Path(trl_python).absolute().parent / "torchrun"), f"--nproc-per-node={workers}",
            str(REPO / "bench" / "trl_sft.py"),
            f"--model={model}", f"--train={train}", f"--val={val}", f"--out={out}", f"--seed={seed}",
            f"--epochs={HYPER['epochs']}", f"--batch-size={HYPER['batch_size']}", f"--max-length={HYPER['max_length']}",
            f"--lr={HYPER['lr']}", f"--warmup-steps={HYPER['warmup_steps']}", f"--lora-r={HYPER['lora_r']}",
            f"--lora-alpha={HYPER['lora_alpha']}", *extra,
        ]  # fmt: skip
    started = time.time()
    with open(out / "log.txt", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work).returncode
    figures = {"side": side, "seed": seed, "exit": code, "wall_s": time.time() - started}
    if code == 0:
        figures |= _service(work, f"bench-{seed}-{side}") if runner == "service" else _trl(out)
    return figures


def _service(work: Path, name: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    run = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string=f"tags.mlflow.runName = '{name}'"
    )[0]

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    tokens, rates = history("train_tokens"), history("tokens_per_s")
    return {
        "tokens": sum(tokens),
        "epoch_s": [t / r for t, r in zip(tokens, rates, strict=True)],
        "peak_mb": max(history("peak_memory_mb")),
        "val_loss": history("val_loss")[-1],
    }


def _trl(out: Path) -> dict:
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {
        "epoch_s": [max(epoch) for epoch in zip(*(r["epoch_s"] for r in ranks), strict=True)],
        "peak_mb": max(r["peak_rss_mb"] for r in ranks),
        "val_loss": ranks[0]["val_loss"],
    }


def summarize(runs: list[dict], workload: dict, sides: list[str]) -> dict:
    """Per side: tokens/s, slowest epoch, peak memory, validation loss (median [min-max] over rounds);
    the goals: best S / best T tokens/s in every round, and S's validation loss against T's in the
    same batch shape (mean over the seeds)."""
    per_epoch = workload["tokens_per_epoch"]
    for r in runs:
        if r["exit"] == 0:
            r["tokens_per_s"] = per_epoch * len(r["epoch_s"]) / sum(r["epoch_s"])
    ok = [r for r in runs if r["exit"] == 0]
    figures = {
        side: {
            key: _spread([f(r) for r in ok if r["side"] == side])
            for key, f in {
                "tokens_per_s": lambda r: r["tokens_per_s"],
                "slowest_epoch_s": lambda r: max(r["epoch_s"]),
                "peak_mb": lambda r: r["peak_mb"],
                "val_loss": lambda r: r["val_loss"],
            }.items()
        }
        for side in sides
    }
    speedups = []
    for seed in sorted({r["seed"] for r in ok}):
        best = {
            runner: max((r["tokens_per_s"] for r in ok if r["seed"] == seed and r["side"][0] == runner), default=None)
            for runner in "ST"
        }
        if best["S"] and best["T"]:
            speedups.append(best["S"] / best["T"])
    losses = {}
    for shape in ("", "-grouped", "-packed"):
        pairs = [
            (s["val_loss"], t["val_loss"])
            for s in ok
            for t in ok
            if s["side"] == f"S{shape}" and t["side"] == f"T{shape}" and s["seed"] == t["seed"]
        ]
        if pairs:
            losses[f"S{shape} / T{shape}"] = statistics.mean(s for s, _ in pairs) / statistics.mean(t for _, t in pairs)
    return {
        "figures": figures,
        "speedup_best_s_over_best_t": speedups,
        "val_loss_ratio": losses,
        "goals": {
            "speedup >= 1.5 in every round": bool(speedups) and min(speedups) >= 1.5,
            "val loss within 5 %": bool(losses) and all(abs(v - 1) <= 0.05 for v in losses.values()),
        },
    }


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def markdown(results: dict) -> str:
    m, w, s = results["machine"], results["workload"], results["summary"]
    lines = [
        f"# chat_sft against TRL's SFTTrainer: {m['name']}",
        "",
        f"{m['cpu']}, {m['cpus']} CPUs; torch {m['torch']}, transformers {m['transformers']}, TRL {m['trl']}, "
        f"ray {m['ray']}. {w['model']}; {w['train_rows']} training conversations of {w['lengths']['min']}-"
        f"{w['lengths']['max']} tokens (median {w['lengths']['median']:.0f}), {w['tokens_per_epoch']:,} tokens an "
        f"epoch; {w['padding_share_in_order']:.0%} of a batch of {HYPER['batch_size']} is padding in file order. "
        f"{results['workers']} processes, LoRA r={HYPER['lora_r']} on every linear layer, {HYPER['epochs']} epochs, "
        f"lr {HYPER['lr']}, max_length {HYPER['max_length']}. Median [min-max] of {results['rounds']} rounds "
        f"(seeds 0, 1, ...){', after a warm-up run of each runner (not counted)' if results.get('warmup') else ''}.",
        "",
        "| side | tokens/s | slowest epoch, s | peak RSS of a worker, MB | validation loss |",
        "|---|---|---|---|---|",
    ]
    for side, f in s["figures"].items():
        cells = [_cell(f["tokens_per_s"], ",.0f"), _cell(f["slowest_epoch_s"], ".1f"), _cell(f["peak_mb"], ",.0f")]
        lines.append(f"| {side} | " + " | ".join([*cells, _cell(f["val_loss"], ".4f")]) + " |")
    speedups = ", ".join(f"{x:.2f}" for x in s["speedup_best_s_over_best_t"])
    lines += [
        "",
        f"Best S over best T, tokens/s, round by round: {speedups} (goal: at least 1.5 in every round: "
        f"{'met' if s['goals']['speedup >= 1.5 in every round'] else 'missed'}).",
        "Validation loss, S over T in the same batch shape (mean of the seeds): "
        + ", ".join(f"{k} {v:.3f}" for k, v in s["val_loss_ratio"].items())
        + f" (goal: within 5 %: {'met' if s['goals']['val loss within 5 %'] else 'missed'}).",
    ]
    return "\n".join(lines) + "\n"


def _cell(spread: dict | None, spec: str) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:{spec}} [{spread['min']:{spec}}-{spread['max']:{spec}}]"


def _machine(trl_python: str) -> dict:
    from importlib.metadata import version

    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "?",
    )
    trl = subprocess.run(
        [trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "name": f"cpu-{os.cpu_count()}core",
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "ray": version("ray"),
        "trl": trl,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", required=True, help="the python of the environment that has TRL")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--train-rows", type=int, default=400)
    parser.add_argument("--val-rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--work", default="/tmp/sft-vs-trl", help="scratch directory (emptied)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        parser.error(f"unknown side(s) {unknown}: the sides are {', '.join(SIDES)}")
    work = Path(args.work)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    workload = write_workload(work / "data", args.train_rows, args.val_rows, args.hidden, args.layers)
    print(json.dumps(workload), flush=True)
    results = {
        "machine": _machine(args.trl_python),
        "workload": workload,
        "workers": args.workers,
        "warmup": not args.no_warmup,
        "runs": [],
    }
    if not args.no_warmup:  # each runner once (its first side), with a seed no round uses
        for runner in dict.fromkeys(SIDES[side][0] for side in sides):
            side = next(side for side in sides if SIDES[side][0] == runner)
            warm = run_side(side, args.rounds, work, args.trl_python, args.workers)
            print(json.dumps({"warm-up (not counted)": warm}), flush=True)
    for seed in range(args.rounds):
        for side in sides if seed % 2 == 0 else sides[::-1]:
            run = run_side(side, seed, work, args.trl_python, args.workers)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
        results["rounds"] = seed + 1
        results["summary"] = summarize(results["runs"], workload, sides)
        stem = Path(args.out) / f"{results['machine']['name']}-chat-sft-vs-trl"
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
