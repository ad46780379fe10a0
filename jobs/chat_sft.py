"""Supervised fine-tuning (SFT) of a Hugging Face causal language model on chat conversations: LoRA
adapters by default, every weight with `model.lora_r=0`.

    raytrain-ddp train chat_sft model.path=<local dir or hub id> dataset.path=<conversations .jsonl/.parquet>
    raytrain-ddp train chat_sft model.path=HuggingFaceTB/SmolLM2-135M-Instruct dataset.path=s3://bucket/chats/ \
        scaling.use_gpu=true train.precision=bf16 model.gradient_checkpointing=true

Rows are conversations `{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`,
prompt/completion pairs `{"prompt", "completion"}` (strings, or lists of messages) or plain `{"text"}`,
told apart by their fields (or `dataset.kind`), from JSONL or Parquet, read with Ray Data. Conversations
are rendered with the chat template of the tokenizer saved with the model, any template: the rules that
find the trained tokens are raytrain_ddp/data/chat.py's. The assistant turns are trained (a
completion's, not its prompt's), each with its end-of-turn token; a completion or a text with the
end-of-sequence token; labels are -100 everywhere else and on padding. A row cut by `dataset.max_length`
so that no trained token is left is dropped and counted; a malformed one stops the run before
training, named.

The loss is a sum over trained tokens with their count (see `compute_loss`), so the service divides a
step's gradient by the trained tokens of the whole global batch, whatever the lengths, micro-batches
and workers. Each evaluation reports the loss and perplexity of the assistant tokens (over all ranks)
and the model's answers to the first validation prompts (MLflow: generated.json). The registered model
is the best checkpoint's, adapters merged into the base, logged with its tokenizer as an MLflow
transformers chat model: `mlflow models serve -m models:/chat-sft/<version>` answers chat requests.

The driver never loads the weights: it checks the recipe on the architecture alone (on PyTorch's
meta device), and registration runs as a Ray task with a worker's resources.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import pyarrow as pa
import ray.data
import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytrain_ddp.data import chat

IGNORE = chat.IGNORE  # the label of a token that is not trained (cross_entropy's ignore_index)
SAMPLE_TOKENS = 48  # at most, per answer to a validation prompt


def _absolute_if_local(path: str) -> str:
    # Made absolute where the config is checked, in the user's directory: workers and Ray Data's tasks
    # run in others. Hub ids and URIs stay as they are.
    local = Path(path).expanduser()
    return str(local.resolve()) if "://" not in path and local.exists() else path


Location = Annotated[str, AfterValidator(_absolute_if_local)]  # a local path, a hub id or a URI


# ---- model -------------------------------------------------------------------------------------


def build_model(
    *,
    path: Location,
    lora_r: Annotated[int, Field(ge=0)] = 16,
    lora_alpha: Annotated[float, Field(gt=0)] = 32.0,
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.05,
    lora_targets: str | list[str] = "all-linear",
    gradient_checkpointing: bool = False,
    precision: str = "fp32",
) -> nn.Module:
    """The pretrained model at `path` (a local directory, or a hub id) with LoRA adapters of rank
    `lora_r` on `lora_targets` (peft's names: "all-linear", or module names such as [q_proj, v_proj]);
    `lora_r=0` trains every weight. Weights: fp32, except a LoRA base under bf16 precision, kept in
    bf16 (frozen, half the memory), with fp32 adapters. `precision` is the run's train.precision."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if lora_r and precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return _adapt(model, lora_r, lora_alpha, lora_dropout, lora_targets, gradient_checkpointing)


def build_empty_model(*, path: str, precision: str = "fp32", **adapters) -> nn.Module:
    """The same model on the meta device (build_model's settings, all of them): its architecture and
    adapters, no weights. The driver checks the recipe with it, so it never holds the real model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    empty = _adapt(empty, **adapters)
    # With no KV cache, transformers tests the positions for packed sequences, a test of values that
    # meta tensors cannot answer; the cache's path computes the same shapes.
    empty.config.use_cache = True
    return empty


def _adapt(model, lora_r, lora_alpha, lora_dropout, lora_targets, gradient_checkpointing) -> nn.Module:
    model.config.use_cache = False  # no KV cache in training (generation turns it on per call)
    if gradient_checkpointing:  # non-reentrant: the reentrant form breaks DDP ("marked ready twice")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not lora_r:
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=lora_targets, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora)


def _tokenizer(path: str):
    # Loaded where it is used (per batch of rows, per evaluation): a cached one would be pickled by name
    # with the recipe, which workers cannot import.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---- data --------------------------------------------------------------------------------------


def build_datasets(
    *,
    seed: int,
    model: dict,
    path: Location,
    val_path: Location | None = None,
    val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1,
    max_length: Annotated[int, Field(ge=8)] = 1024,
    format: Literal["auto", "jsonl", "parquet"] = "auto",
    kind: Literal["auto", "messages", "prompt_completion", "text"] = "auto",
    packing: Literal["none", "bfd"] = "none",
) -> dict[str, ray.data.Dataset]:
    """Rows at `path` (a file or a directory, local or s3://), tokenized with model.path's tokenizer;
    validation from `val_path`, or `val_fraction` of them held out (chosen by `seed`). `format` auto:
    .jsonl/.json files are JSON lines, anything else Parquet. `kind`: what a row holds (chat.py's
    formats); auto tells them apart by their fields. `packing` bfd: the training rows packed into rows
    of `max_length` tokens (chat.pack; validation stays a row each)."""
    tokenizer_path = model["path"]
    tokenizer = _tokenizer(tokenizer_path)
    _check_template(tokenizer, tokenizer_path, kind)  # said here, before any Ray task reads a row
    train = _read(path, format, kind, "dataset.path")
    if val_path is None:
        train, val = train.train_test_split(test_size=val_fraction, shuffle=True, seed=seed)
    else:
        val = _read(val_path, format, kind, "dataset.val_path")
    settings = {"tokenizer_path": tokenizer_path, "max_length": max_length, "kind": kind}
    train = _tokenized(train, settings, "dataset.path")
    if packing == "bfd":
        train = _packed(train, max_length, _pad_id(tokenizer))
    return {"train": train, "val": _tokenized(val, settings, "dataset.val_path" if val_path else "dataset.path")}


def _check_template(tokenizer, tokenizer_path: str, kind: str) -> None:
    """The tokenizer's chat template (where rows may be conversations) can be labelled."""
    if kind == "text" or (kind != "messages" and not tokenizer.chat_template):
        return  # a conversation among the rows is then refused as a malformed row, saying why
    try:
        chat.check_template(tokenizer)
    except chat.LabelError as e:
        raise ValueError(f"model.path={tokenizer_path}: {e}") from None


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


PACK_ROWS = 4096  # rows packed together: bins are filled from this many at a time


def _packed(rows: ray.data.Dataset, max_length: int, pad: int) -> ray.data.Dataset:
    """The rows packed into rows of `max_length` tokens, best-fit decreasing (chat.pack), deterministic."""
    before = rows.count()
    packed = rows.map_batches(
        chat.pack, fn_kwargs={"capacity": max_length, "pad": pad}, batch_size=PACK_ROWS, batch_format="numpy"
    ).materialize()
    after, tokens = packed.count(), packed.sum("length")
    print(
        f"dataset.path: {before} rows packed into {after} rows of dataset.max_length={max_length} tokens "
        f"({tokens / (after * max_length):.0%} of them tokens, the rest padding)"
    )
    return packed


COLUMNS = {"messages": ["messages"], "prompt_completion": ["prompt", "completion"], "text": ["text"]}


def _read(path: str, format: str, kind: str, key: str) -> ray.data.Dataset:
    """JSON lines as text, each parsed by the recipe (a row pyarrow could not type, a number for a
    content say, is then named like any other malformed row); Parquet with the columns of its kind."""
    if format == "jsonl" or (format == "auto" and Path(path).suffix in (".jsonl", ".json")):
        return ray.data.read_text(path).rename_columns({"text": "line"})  # a JSON line, not a row's text
    table = ray.data.read_parquet(path)
    names = table.schema().names
    kinds = [kind] if kind != "auto" else list(COLUMNS)
    for candidate in kinds:
        if set(COLUMNS[candidate]) <= set(names):
            return table.select_columns(COLUMNS[candidate])
    wanted = " or ".join("+".join(COLUMNS[k]) for k in kinds)
    raise ValueError(f"{key}={path}: the Parquet files have columns {names}, not {wanted} (dataset.kind={kind})")


def _tokenized(rows: ray.data.Dataset, settings: dict, key: str) -> ray.data.Dataset:
    """Token ids, labels and length of each row, right-padded to `max_length`. Malformed rows stop the
    run here, named; rows with no trained token left after truncation are dropped, counted."""
    rows = rows.map_batches(_tokenize_batch, fn_kwargs=settings, batch_format="pyarrow").materialize()
    problems = np.concatenate(
        [b["problem"] for b in rows.select_columns(["problem"]).iter_batches(batch_format="numpy")] or [[]]
    )
    malformed = [p for p in problems if p and not p.startswith("dropped")]
    max_length = settings["max_length"]
    if malformed:
        shown = "\n  ".join(malformed[:5])
        raise ValueError(f"{key}: {len(malformed)} malformed row(s) of {len(problems)}:\n  {shown}")
    dropped = sum(1 for p in problems if p)
    if dropped == len(problems):
        raise ValueError(f"{key}: no row has a trained token within dataset.max_length={max_length}")
    if dropped:
        print(
            f"{key}: dropped {dropped} of {len(problems)} rows with no trained token within "
            f"dataset.max_length={max_length}"
        )
    return rows.map_batches(_kept, batch_format="numpy").materialize()


def _kept(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    keep = batch["problem"] == ""
    return {k: v[keep] for k, v in batch.items() if k != "problem"}


def _tokenize_batch(batch: pa.Table, tokenizer_path: str, max_length: int, kind: str = "auto") -> dict[str, np.ndarray]:
    tokenizer = _tokenizer(tokenizer_path)
    pad = _pad_id(tokenizer)
    n = batch.num_rows
    ids, labels = np.full((n, max_length), pad, np.int32), np.full((n, max_length), IGNORE, np.int32)
    lengths, problems = np.zeros(n, np.int32), []
    for i, row in enumerate(_rows(batch)):
        try:
            row_ids, row_labels = tokenize(row, tokenizer, max_length, kind)
        except ValueError as e:
            problems.append(f"{e}: {str(row)[:120]}")
            continue
        lengths[i] = len(row_ids)
        ids[i, : len(row_ids)], labels[i, : len(row_ids)] = row_ids, row_labels
        problems.append("" if any(label != IGNORE for label in row_labels) else "dropped")
    return {"input_ids": ids, "labels": labels, "length": lengths, "problem": np.array(problems, dtype=object)}


def _rows(batch: pa.Table) -> list[object]:
    """The batch's rows as Python objects: parsed JSON lines, or Parquet's columns."""
    if batch.column_names != ["line"]:
        return batch.to_pylist()
    rows = []
    for line in batch.column("line").to_pylist():
        try:
            rows.append(json.loads(line))
        except ValueError:
            rows.append(line)  # not JSON: refused as a row that is not an object, shown as it is
    return rows


def tokenize(row: object, tokenizer, max_length: int, kind: str = "auto") -> tuple[list[int], list[int]]:
    """A row's token ids and labels (chat.py's rules), cut to `max_length`."""
    ids, labels = chat.label(row, tokenizer, kind)
    return ids[:max_length], labels[:max_length]


# ---- training and evaluation -------------------------------------------------------------------


def _forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden state of each position that predicts a trained token, and that token. Rows are
    cut to the batch's longest; right padding under a causal mask: no real token sees a pad, so no
    attention mask is needed. Packed rows carry position ids that restart at each of their rows:
    transformers keeps attention within each. The model computes no logits (`logits_to_keep` of no
    position): the loss computes those it needs, a chunk at a time (`_token_loss`)."""
    n = int(batch["length"].max())
    ids, labels = batch["input_ids"][:, :n].long(), batch["labels"][:, :n].long()
    positions = batch["position_ids"][:, :n].long() if "position_ids" in batch else None
    # Packed rows: no KV cache, which would turn transformers' packed-sequence masks off (the driver's
    # meta model keeps its cache: the masks' test of values cannot run on meta tensors).
    packed = {} if positions is None else {"position_ids": positions, "use_cache": False}
    if model.device.type == "meta":
        # Gradient checkpointing turns the cache off in training, and without one transformers reads
        # the positions' values for packed rows: an empty cache of its own keeps the meta model's masks
        # to shapes.
        from transformers import DynamicCache

        packed["past_key_values"] = DynamicCache(config=model.config)
    none = torch.empty(0, dtype=torch.long, device=ids.device)
    last = model(input_ids=ids, logits_to_keep=none, output_hidden_states=True, **packed).hidden_states[-1]
    hidden, labels = last[:, :-1], labels[:, 1:].to(last.device)
    if hidden.is_meta:
        # Shapes only (the driver's check, the FLOP count): every position, as MFU counts the output
        # layer's FLOPs; which are trained is a value meta tensors do not hold.
        return hidden.flatten(0, 1), labels.flatten()
    trained = labels != IGNORE
    return hidden[trained], labels[trained]


LOGITS_PER_CHUNK = 2**25  # the loss's logits held at once (positions x vocabulary): 128 MiB in fp32


def _chunks(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor):
    """The output layer, and the positions in chunks of at most LOGITS_PER_CHUNK logits (one empty
    chunk where there is no position, so that the output layer is still in the graph: DDP expects a
    gradient for every parameter)."""
    head = (model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model).get_output_embeddings()
    size = max(1, LOGITS_PER_CHUNK // head.weight.shape[0])
    return head, zip(hidden.split(size), labels.split(size), strict=True)


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE, reduction="sum")


def _token_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the cross-entropy of `labels`, their count). Each chunk's logits are made, summed into
    the loss and freed, then made again in the backward pass (activation checkpointing): the peak is
    one chunk's logits, not every position's, for one more product by the output layer per trained
    token (the model made none for prompts and padding)."""
    head, chunks = _chunks(model, hidden, labels)
    # Not on meta tensors: the FLOP count counts the model's FLOPs, not the recomputation's
    again = torch.is_grad_enabled() and not hidden.is_meta
    loss = sum(
        checkpoint(_chunk_loss, head, h, y, use_reentrant=False) if again else _chunk_loss(head, h, y)
        for h, y in chunks
    )
    return loss, (labels != IGNORE).sum()


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the trained tokens' cross-entropy, their count): the service divides by the count of the
    whole global batch."""
    return _token_loss(model, *_forward(model, batch))


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per trained (assistant) token: loss in nats, and whether the most likely token is the right one."""
    hidden, labels = _forward(model, batch)
    head, chunks = _chunks(model, hidden, labels)
    loss = correct = torch.zeros((), device=hidden.device)
    for h, y in chunks:
        logits = head(h).float()
        loss = loss + F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
        correct = correct + ((logits.argmax(-1) == y) & (y != IGNORE)).sum()
    trained = (labels != IGNORE).sum()
    return {"loss": (loss, trained), "token_accuracy": (correct, trained)}


def derived_metrics(val: dict[str, float]) -> dict[str, float]:
    return {"perplexity": math.exp(min(val["loss"], 50.0))}


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["length"].sum())


# ---- what the model says, and how it is registered ---------------------------------------------


@torch.no_grad()
def generate_samples(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[dict[str, str]]:
    """The model's greedy answer to each row's first prompt (the row up to its first trained token: a
    conversation's first trained assistant turn; a text's first half), beside the reference answer."""
    tokenizer = _tokenizer(model.name_or_path)
    out = []
    for ids, labels, length in zip(batch["input_ids"], batch["labels"], batch["length"]):
        ids, labels = ids[: int(length)].long(), labels[: int(length)]
        trained = (labels != IGNORE).nonzero().flatten()
        start = int(trained[0]) or max(1, int(length) // 2)  # a text, trained from its first token: half of it
        trained = trained[trained >= start]
        end = start + int((trained - start == torch.arange(len(trained), device=trained.device)).sum())
        generated = model.generate(
            input_ids=ids[None, :start],
            max_new_tokens=SAMPLE_TOKENS,
            do_sample=False,
            use_cache=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )[0, start:]
        out.append(
            {
                "prompt": tokenizer.decode(ids[:start]),
                "reference": tokenizer.decode(ids[start:end], skip_special_tokens=True),
                "generated": tokenizer.decode(generated, skip_special_tokens=True),
            }
        )
    return out


def log_model(model: nn.Module, *, name: str):
    """The adapters merged into the base (one plain transformers model), logged with the tokenizer as
    an MLflow transformers chat model (task llm/v1/chat: OpenAI-style chat requests and answers), or,
    for a tokenizer without a chat template (a model tuned on text), a completions model."""
    import mlflow
    import transformers

    merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    merged.config.use_cache = True
    tokenizer = _tokenizer(merged.name_or_path)
    return mlflow.transformers.log_model(
        transformers_model={"model": merged, "tokenizer": tokenizer},
        name=name,
        **(
            {
                "task": "llm/v1/chat",
                "input_example": {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16},
            }
            if tokenizer.chat_template
            else {"task": "llm/v1/completions", "input_example": {"prompt": "Hello", "max_tokens": 16}}
        ),
        pip_requirements=[
            f"torch=={torch.__version__.split('+')[0]}",
            f"transformers=={transformers.__version__}",
            f"mlflow=={mlflow.__version__}",
        ],
    )
