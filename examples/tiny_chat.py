"""A tiny chat model and conversations to try `chat_sft` with no download: a Llama-architecture model
with random weights (2 layers, hidden size 64), a BPE tokenizer trained on the conversations, with a
chat template, both written with `save_pretrained`; generated conversations as JSONL; and the settings
that fine-tune this model (a config layered over jobs/chat_sft.yaml).

    .venv/bin/python examples/tiny_chat.py tiny-chat
    raytrain-ddp train chat_sft --config tiny-chat/chat_sft.yaml

The conversations are small facts about made-up people (favourite colour, city, number) and requests
to repeat a few words; some open with a system message, some have two or three exchanges. The tests
train on them too (tests/system/test_chat_sft.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import yaml

NAMES = ["Ada", "Bram", "Cleo", "Dmitri", "Esme", "Farid", "Greta", "Hugo"]
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
CITIES = ["Lisbon", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth", "Riga", "Turin", "Hanoi"]
WORDS = ["river", "stone", "cloud", "maple", "lantern", "copper", "meadow", "harbor", "violet", "ember"]
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
# A ChatML-like template: each turn is <|start|>role, newline, content, <|end|>; a generation prompt
# opens the assistant's turn. The model ends its turn with <|end|>, its end-of-sequence token.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
INIT = 0.2  # larger than Llama's 0.02: logits far from uniform, as a pretrained model's are
SPECIAL = ["<|pad|>", "<|start|>", "<|end|>"]


def facts(seed: int = 1234) -> dict[str, dict[str, str]]:
    """Each person's colour, city and number: fixed by `seed`, so train and validation agree."""
    rng = random.Random(seed)
    return {
        name: {"colour": rng.choice(COLOURS), "city": rng.choice(CITIES), "number": str(rng.randint(2, 99))}
        for name in NAMES
    }


def exchange(rng: random.Random, known: dict[str, dict[str, str]]) -> tuple[str, str]:
    """One question and its answer."""
    name = rng.choice(NAMES)
    kind = rng.choice(["colour", "city", "number", "repeat"])
    if kind == "colour":
        return f"What is the favourite colour of {name}?", f"{name} likes {known[name]['colour']}."
    if kind == "city":
        return f"Where does {name} live?", f"{name} lives in {known[name]['city']}."
    if kind == "number":
        return f"What is the lucky number of {name}?", f"The lucky number of {name} is {known[name]['number']}."
    words = " ".join(rng.sample(WORDS, rng.randint(2, 4)))
    return f"Repeat after me: {words}", words


def conversations(n: int, seed: int) -> list[dict]:
    """`n` conversations in the `{"messages": [{"role", "content"}, ...]}` form chat_sft reads."""
    rng, known = random.Random(seed), facts()
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for _ in range(rng.choice([1, 1, 2, 3])):
            question, answer = exchange(rng, known)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, with the chat template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        clean_up_tokenization_spaces=False,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


def build_model(vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0):
    """A Llama-architecture causal LM with random weights, small enough to train on a laptop's CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        initializer_range=INIT,
    )
    return LlamaForCausalLM(config)


def settings(directory: Path) -> dict:
    """chat_sft's settings for this model: every key jobs/chat_sft.yaml sets, so the same file layers
    over another recipe's defaults alike. A random base needs more than real LoRA fine-tuning: adapters
    on the output layer too, a high learning rate, no clipping."""
    return {
        "model": {
            "path": str(directory / "model"),
            "lora_r": 16,
            "lora_alpha": 32,
            "lora_dropout": 0.05,
            "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
            "gradient_checkpointing": False,
        },
        "dataset": {
            "path": str(directory / "train.jsonl"),
            "val_path": str(directory / "val.jsonl"),
            "val_fraction": 0.1,
            "max_length": 128,
        },
        "train": {
            "epochs": 12,
            "batch_size": 8,
            "lr": 1.0e-2,
            "weight_decay": 0.0,
            "lr_schedule": "cosine",
            "warmup_steps": 5,
            "grad_clip_norm": None,
            "eval_batch_size": 16,
        },
        "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}},
        "checkpoint": {"num_to_keep": 2, "score_attribute": "val_loss", "score_order": "min"},
        "mlflow": {"model_name": "chat-sft"},
    }


def write(directory: str | Path, *, train: int = 240, val: int = 48) -> Path:
    """Write `model/` (model and tokenizer), `train.jsonl`, `val.jsonl` and `chat_sft.yaml` into
    `directory`."""
    from transformers import GenerationConfig

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    train_rows, val_rows = conversations(train, seed=1), conversations(val, seed=2)
    texts = [m["content"] for row in train_rows + val_rows for m in row["messages"]] + ["user", "assistant", "system"]
    tokenizer = build_tokenizer(texts, vocab_size=512)
    model = build_model(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    # Greedy answers, said explicitly: with a generation config derived from the model's, transformers'
    # text-generation pipeline (what MLflow serves) samples at temperature 0.7 instead.
    model.generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=48, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    write_jsonl(directory / "train.jsonl", train_rows)
    write_jsonl(directory / "val.jsonl", val_rows)
    header = f"# The tiny chat model's settings: raytrain-ddp train chat_sft --config {directory / 'chat_sft.yaml'}\n"
    (directory / "chat_sft.yaml").write_text(header + yaml.safe_dump(settings(directory), sort_keys=False))
    return directory


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write model/, train.jsonl, val.jsonl and chat_sft.yaml")
    parser.add_argument("--train", type=int, default=240, help="training conversations")
    parser.add_argument("--val", type=int, default=48, help="validation conversations")
    args = parser.parse_args()
    out = write(args.directory, train=args.train, val=args.val)
    print(f"wrote {out}/model (tiny Llama + tokenizer), {out}/train.jsonl, {out}/val.jsonl, {out}/chat_sft.yaml")
    print(f"train it: raytrain-ddp train chat_sft --config {out}/chat_sft.yaml")
