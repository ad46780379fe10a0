"""TRL's side of bench/sft_vs_trl.py: SFTTrainer on the benchmark's model and conversations, run by
`torchrun --nproc-per-node N` in the environment that has TRL (`make bench-trl` makes it).

Each rank times every epoch's training steps (a callback's epoch begin -> end: no evaluation or
saving happens in between) and writes them, with its peak RSS, to `<out>/rank<r>.json`; rank 0 then
scores the trained model on the validation conversations with chat_sft's own `evaluate` (the
service's validation loss, token for token), so both sides are judged by one function.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--train", "--val", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=640)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--packing", choices=["none", "bfd"], default="none")
    parser.add_argument("--group-by-length", action="store_true")
    args = parser.parse_args()

    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class EpochClock(TrainerCallback):
        def __init__(self) -> None:
            self.epochs: list[float] = []

        def on_epoch_begin(self, *_, **__) -> None:
            self.started = time.perf_counter()

        def on_epoch_end(self, *_, **__) -> None:
            self.epochs.append(time.perf_counter() - self.started)

    out = Path(args.out)
    config = SFTConfig(
        output_dir=str(out / "trainer"),
        seed=args.seed,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_length=args.max_length,
        assistant_only_loss=True,
        packing=args.packing == "bfd",
        packing_strategy="bfd",
        train_sampling_strategy="group_by_length" if args.group_by_length else "random",
        bf16=False,
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        eval_strategy="no",
        save_strategy="no",
        logging_steps=10_000,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    clock = EpochClock()
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=load_dataset("json", data_files=args.train, split="train"),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[clock],
    )
    trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    figures = {"epoch_s": clock.epochs, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if rank == 0:
        figures["val_loss"] = validation_loss(trainer.model, tokenizer, args.val, args.max_length)
    (out / f"rank{rank}.json").write_text(json.dumps(figures))


def validation_loss(model: torch.nn.Module, tokenizer, path: str, max_length: int) -> float:
    """chat_sft's validation loss: its tokenization and its `evaluate`, summed over every token."""
    spec = importlib.util.spec_from_file_location("chat_sft", REPO / "jobs" / "chat_sft.py")
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    model.eval()
    loss = count = 0.0
    with torch.no_grad():
        for line in Path(path).read_text().splitlines():
            ids, labels = sft.tokenize(json.loads(line), tokenizer, max_length)
            row = {
                "input_ids": torch.tensor([ids]),
                "labels": torch.tensor([labels]),
                "length": torch.tensor([len(ids)]),
            }
            total, n = sft.evaluate(model, row)["loss"]
            loss, count = loss + float(total), count + float(n)
    return loss / count


if __name__ == "__main__":
    main()
