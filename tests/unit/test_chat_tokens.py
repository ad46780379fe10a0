"""chat_sft's tokenization: which tokens are trained, what is dropped, what is refused, for each format
and for templates that rewrite earlier turns. Checked token by token against an independent oracle (the
character spans of the assistant turns in the rendered text), or against the trained text each rule
must give, written out here."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

JOBS = Path(__file__).parents[2] / "jobs"
IGNORE = -100
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the favourite colour of Iris?"},
    {"role": "assistant", "content": "Iris likes white."},
    {"role": "user", "content": "Repeat after me: stone harbor"},
    {"role": "assistant", "content": "stone harbor"},
]


@pytest.fixture(scope="module")
def sft():
    spec = importlib.util.spec_from_file_location("chat_sft_under_test", JOBS / "chat_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(sft, tiny_chat):
    return sft._tokenizer(str(tiny_chat / "model"))


def _assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of each assistant turn's content and its end-of-turn marker and newline."""
    spans, start = [], 0
    while (opened := text.find("<|start|>assistant\n", start)) != -1:
        begin = opened + len("<|start|>assistant\n")
        end = text.index("<|end|>", begin) + len("<|end|>\n")
        spans.append((begin, end))
        start = end
    return spans


def test_only_assistant_turns_and_their_end_of_turn_are_trained_token_by_token(sft, tokenizer):
    ids, labels = sft.tokenize({"messages": CONVERSATION}, tokenizer, max_length=512)

    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    assert encoded["input_ids"] == ids  # the oracle tokenizes the same text the same way
    spans = _assistant_spans(text)
    assert len(spans) == 2
    for token, label, (begin, end) in zip(ids, labels, encoded["offset_mapping"]):
        in_assistant = any(b <= begin and end <= e for b, e in spans)
        assert label == (token if in_assistant else IGNORE), (tokenizer.decode([token]), begin, end)
    trained = [i for i, label in zip(ids, labels) if label != IGNORE]
    assert tokenizer.decode(trained) == "Iris likes white.<|end|>\nstone harbor<|end|>\n"


def test_truncation_keeps_the_start_and_a_conversation_with_no_assistant_token_left_is_dropped(sft, tokenizer):
    full_ids, full_labels = sft.tokenize({"messages": CONVERSATION}, tokenizer, max_length=512)
    first_trained = next(i for i, label in enumerate(full_labels) if label != IGNORE)

    ids, labels = sft.tokenize({"messages": CONVERSATION}, tokenizer, max_length=first_trained + 2)
    assert ids == full_ids[: first_trained + 2] and labels == full_labels[: first_trained + 2]

    table = pa.table({"messages": [CONVERSATION, CONVERSATION[:3]]})
    out = sft._tokenize_batch(table, tokenizer_path=tokenizer.name_or_path, max_length=first_trained)
    assert list(out["problem"]) == ["dropped", "dropped"]  # only prompt tokens fit: nothing to train
    short = len(sft.tokenize({"messages": CONVERSATION[:3]}, tokenizer, max_length=512)[0])
    assert short < 48 < len(full_ids)
    out = sft._tokenize_batch(table, tokenizer_path=tokenizer.name_or_path, max_length=48)
    assert list(out["problem"]) == ["", ""]
    assert out["input_ids"].shape == (2, 48) and list(out["length"]) == [48, short]
    assert (out["labels"][1, short:] == IGNORE).all()  # padding is never trained
    assert (out["input_ids"][1, short:] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "bot", "content": "hi"}], "message 0 has role 'bot'; roles are system, user, assistant"),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": 4}], "message 0 (user) has content"),
        (None, "'messages' is missing or not a non-empty list"),
        ([{"role": "user", "content": "hello"}], "no assistant message in 'messages'"),
    ],
    ids=["unknown-role", "content-not-text", "no-messages", "no-assistant"],
)
def test_a_malformed_conversation_is_refused_with_the_row_named(sft, tokenizer, messages, says):
    table = pa.table({"messages": pa.array([messages], type=pa.string() if messages is None else None)})
    out = sft._tokenize_batch(table, tokenizer_path=tokenizer.name_or_path, max_length=64)
    [problem] = out["problem"]
    assert problem.startswith(says)
    assert str({"messages": messages})[:40] in problem  # the row itself, to find it in the file


# ---- templates that rewrite earlier turns --------------------------------------------------------

TURN = "<|start|>{{ m['role'] }}\n"
OPEN = "{% for m in messages %}"
CLOSE = "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
TEMPLATES = {
    # marks what is trained: the tokenizer's assistant mask
    "generation": OPEN + TURN + "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}\n" + CLOSE,
    # another end-of-turn token for the final message
    "final-token": OPEN + TURN + "{{ m['content'] }}{% if loop.last %}<|final|>{% else %}<|end|>{% endif %}\n" + CLOSE,
    # reasoning dropped from earlier assistant turns
    "reasoning": OPEN + TURN + "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1].lstrip() }}{% else %}{{ m['content'] }}{% endif %}<|end|>\n" + CLOSE,
    # the time in the system block: no two renders alike
    "clock": "<|start|>system\nNow {{ strftime_now('%H:%M:%S.%f') }}<|end|>\n" + OPEN + TURN + "{{ m['content'] }}"
    "<|end|>\n" + CLOSE,
}
THINKING = [
    {"role": "user", "content": "What is the favourite colour of Iris?"},
    {"role": "assistant", "content": "<think>\nIris is in the facts.\n</think>\n\nIris likes white."},
    {"role": "user", "content": "Repeat after me: stone harbor"},
    {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nstone harbor"},
]


@pytest.fixture
def templated(tokenizer):
    """The tiny tokenizer with another chat template, and <|final|> as one more special token."""

    def make(template: str):
        other = copy.deepcopy(tokenizer)
        other.add_special_tokens({"additional_special_tokens": ["<|final|>"]})
        other.chat_template = TEMPLATES[template]
        return other

    return make


def _trained(ids: list[int], labels: list[int], tokenizer) -> list[str]:
    """The trained tokens as text, one string for each run of consecutive trained positions; and every
    trained position's label is its own token."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return [tokenizer.decode(run) for run in [*runs, current] if run]


@pytest.mark.parametrize(
    ("template", "messages", "rule", "runs"),
    [
        ("generation", CONVERSATION, "generation", ["Iris likes white.<|end|>", "stone harbor<|end|>"]),
        ("final-token", CONVERSATION, "render", ["Iris likes white.<|end|>", "stone harbor<|final|>"]),
        (
            "reasoning",
            THINKING,
            "render",
            ["Iris likes white.<|end|>", "<think>\nEasy.\n</think>\n\nstone harbor<|end|>"],
        ),
        ("clock", CONVERSATION, "render", ["Iris likes white.<|end|>", "stone harbor<|end|>"]),
    ],
    ids=["generation-marks", "final-token", "reasoning-dropped", "clock-in-system"],
)
def test_a_template_that_rewrites_earlier_turns_trains_each_assistant_turn_and_its_end(
    sft, templated, template, messages, rule, runs
):
    from raytrain_ddp.data import chat

    tokenizer = templated(template)
    assistants = {k for k, message in enumerate(messages) if message["role"] == "assistant"}
    assert chat.labelled(messages, assistants, tokenizer)[0] == rule
    ids, labels = sft.tokenize({"messages": messages}, tokenizer, max_length=512)
    assert _trained(ids, labels, tokenizer) == runs
    if template != "clock":  # the ids are the template's own tokens of the conversation
        assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def test_a_template_none_of_the_rules_can_label_is_refused_naming_why_and_the_fix(templated):
    from raytrain_ddp.data import chat

    tokenizer = templated("final-token")
    tokenizer.chat_template = tokenizer.chat_template.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")
    with pytest.raises(chat.LabelError, match=r"renders assistant message 2 without its content: mark each assistant"):
        chat.check_template(tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(chat.LabelError, match="the tokenizer has no chat template, which conversations need"):
        chat.label({"messages": CONVERSATION}, tokenizer)


# ---- formats ------------------------------------------------------------------------------------


def test_a_plain_prompt_and_completion_trains_the_completion_and_its_end_of_sequence(sft, tokenizer):
    row = {"prompt": "Where does Ada live?", "completion": " Ada lives in Oslo."}
    ids, labels = sft.tokenize(row, tokenizer, max_length=512)
    prompt = tokenizer(row["prompt"])["input_ids"]
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [IGNORE] * len(prompt)
    assert _trained(ids, labels, tokenizer) == [" Ada lives in Oslo.<|end|>"]


def test_a_conversational_completion_trains_its_assistant_turns_not_the_prompts(sft, tokenizer):
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    ids, labels = sft.tokenize(row, tokenizer, max_length=512)
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert _trained(ids, labels, tokenizer) == ["stone harbor<|end|>\n"]  # the earlier answer is context


def test_a_text_trains_every_token_and_its_end_of_sequence(sft, tokenizer):
    ids, labels = sft.tokenize({"text": "Ada lives in Oslo."}, tokenizer, max_length=512)
    assert labels == ids and tokenizer.decode(ids) == "Ada lives in Oslo.<|end|>"
    assert sft.tokenize({"text": "Ada lives in Oslo."}, tokenizer, max_length=3) == (ids[:3], ids[:3])


@pytest.mark.parametrize(
    ("row", "kind", "says"),
    [
        ({"question": "hi"}, "auto", "the row has none of 'messages', 'prompt' and 'completion', 'text'"),
        (
            {"prompt": "hi", "completion": [{"role": "assistant", "content": "x"}]},
            "auto",
            "'prompt' and 'completion' are not both strings",
        ),
        ({"prompt": "hi", "completion": ""}, "auto", "'prompt' and 'completion' are not both strings (a non-empty"),
        (
            {"prompt": CONVERSATION[:2], "completion": [{"role": "user", "content": "x"}]},
            "auto",
            "no assistant message in 'completion'",
        ),
        ({"text": 3}, "auto", "'text' is missing or not a non-empty string"),
        ({"messages": CONVERSATION}, "text", "'text' is missing"),
        ("not json", "auto", "the row has none of"),
    ],
    ids=[
        "no-known-field",
        "mixed-types",
        "empty-completion",
        "completion-without-assistant",
        "text-not-a-string",
        "kind-set",
        "not-an-object",
    ],
)
def test_a_malformed_row_of_any_format_is_refused_with_the_row_named(sft, tokenizer, row, kind, says):
    table = pa.table({"line": [row if isinstance(row, str) else json.dumps(row)]})
    out = sft._tokenize_batch(table, tokenizer_path=tokenizer.name_or_path, max_length=64, kind=kind)
    [problem] = out["problem"]
    assert problem.startswith(says), problem
    assert str(row)[:30] in problem


# ---- packing ------------------------------------------------------------------------------------


def test_best_fit_decreasing_fills_the_fullest_bin_each_row_fits_and_is_deterministic():
    from raytrain_ddp.data import chat

    assert chat.best_fit_decreasing([5, 4, 3, 3, 2, 1], capacity=6) == [[0, 5], [1, 4], [2, 3]]  # 3 full bins
    lengths = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5] * 5
    bins = chat.best_fit_decreasing(lengths, capacity=12)
    assert sorted(i for b in bins for i in b) == list(range(50))  # every row once
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert len(bins) == -(-sum(lengths) // 12)  # as few bins as the tokens need, here
    assert chat.best_fit_decreasing(lengths, capacity=12) == bins


@pytest.fixture(scope="module")
def packed_and_apart(sft, tokenizer, tiny_chat):
    """Six conversations of the tiny chat (two of them text rows), one a row and packed into rows of 128."""
    from raytrain_ddp.data import chat

    rows = [json.loads(line) for line in (tiny_chat / "train.jsonl").read_text().splitlines()[:4]]
    rows += [{"text": "Ada lives in Oslo. Bram lives in Lima."}, {"text": "stone harbor river"}]
    encoded = [sft.tokenize(row, tokenizer, max_length=128) for row in rows]
    apart = {
        "input_ids": np.full((len(rows), 128), tokenizer.pad_token_id),
        "labels": np.full((len(rows), 128), IGNORE),
        "length": np.array([len(ids) for ids, _ in encoded]),
    }
    for i, (ids, labels) in enumerate(encoded):
        apart["input_ids"][i, : len(ids)], apart["labels"][i, : len(ids)] = ids, labels
    packed = chat.pack(apart, capacity=128, pad=tokenizer.pad_token_id)
    assert len(packed["input_ids"]) < len(rows)  # some rows do share one
    return {name: torch.from_numpy(c) for name, c in apart.items()}, {n: torch.from_numpy(c) for n, c in packed.items()}


def _assert_grads_close(actual, expected):
    """Each gradient is a sum over every trained token, summed in another order: float32 rounding then
    differs by a fraction of the gradient's own scale, not by a fixed amount."""
    for name, grad in expected.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(
            actual[name], grad, rtol=1e-4, atol=1e-3 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def _loss_and_grads(sft, model, batch):
    model.zero_grad()
    loss, count = sft.compute_loss(model, batch)
    loss.backward()
    return loss.detach(), int(count), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_train_the_same_tokens_with_the_same_loss_and_gradients_as_apart(
    sft, tiny_chat, packed_and_apart, attention
):
    """The summed token loss and every gradient of six rows packed equal those of the six apart; with
    positions that do not restart, or attention that crosses rows (a full attention mask turns
    transformers' packed-sequence masking off), they do not."""
    from transformers import AutoModelForCausalLM

    apart, packed = packed_and_apart
    model = AutoModelForCausalLM.from_pretrained(tiny_chat / "model", attn_implementation=attention)
    loss, count, grads = _loss_and_grads(sft, model, apart)
    packed_loss, packed_count, packed_grads = _loss_and_grads(sft, model, packed)
    assert packed_count == count
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-4)
    _assert_grads_close(packed_grads, grads)

    no_restart = dict(packed, position_ids=torch.arange(128).expand_as(packed["position_ids"]).contiguous())
    assert not torch.allclose(_loss_and_grads(sft, model, no_restart)[0], loss, rtol=1e-4)
    crossing = model.forward

    def forward(**kwargs):
        return crossing(**kwargs, attention_mask=torch.ones_like(kwargs["input_ids"]))

    model.forward = forward
    assert not torch.allclose(_loss_and_grads(sft, model, packed)[0], loss, rtol=1e-4)


# ---- the loss in chunks -------------------------------------------------------------------------


def _reference(model, batch):
    """The loss of every position's logits at once, as the recipe computed it before chunking."""
    n = int(batch["length"].max())
    logits = model(input_ids=batch["input_ids"][:, :n].long()).logits[:, :-1]
    labels = batch["labels"][:, 1:n].long()
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
    return loss, int((labels != IGNORE).sum()), int(correct)


@pytest.mark.parametrize("lora_on_the_output_layer", [False, True])
def test_the_loss_in_chunks_of_positions_equals_the_loss_at_once_with_its_gradients(
    sft, tiny_chat, packed_and_apart, monkeypatch, lora_on_the_output_layer
):
    """compute_loss and evaluate, 7 positions a chunk (trained ones only, the output layer called as a
    module: LoRA on it trains), against every position's logits at once: the same loss, count,
    gradients and token accuracy."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    apart, _ = packed_and_apart
    model = AutoModelForCausalLM.from_pretrained(tiny_chat / "model")
    targets = ["q_proj", "v_proj", "lm_head"] if lora_on_the_output_layer else ["q_proj", "v_proj"]
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    vocabulary = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(sft, "LOGITS_PER_CHUNK", 7 * vocabulary)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lm_head" in n for n in trained) == lora_on_the_output_layer

    model.zero_grad()
    loss, count, correct = _reference(model, apart)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    chunked, chunked_count, grads = _loss_and_grads(sft, model, apart)
    assert chunked_count == count > 7 * 4  # several chunks
    torch.testing.assert_close(chunked, loss.detach(), rtol=1e-5, atol=1e-4)
    _assert_grads_close(grads, expected)

    with torch.no_grad():
        scores = sft.evaluate(model, apart)
    torch.testing.assert_close(scores["loss"][0], loss.detach(), rtol=1e-5, atol=1e-4)
    assert int(scores["token_accuracy"][0]) == correct and int(scores["loss"][1]) == count


@pytest.mark.parametrize("lora_r", [0, 16], ids=["full", "lora"])
def test_pre_flight_runs_the_loss_of_the_meta_model_with_gradient_checkpointing(sft, tiny_chat, lora_r):
    """The driver checks the recipe on the architecture alone (meta tensors), in training mode, where
    gradient checkpointing turns transformers' cache off: the loss still takes shapes only (every
    8-GPU config sets model.gradient_checkpointing)."""
    from raytrain_ddp import load_config
    from raytrain_ddp.config import recipe as recipes
    from raytrain_ddp.preflight.recipe_check import check_recipe

    settings = [f"model.path={tiny_chat / 'model'}", f"model.lora_r={lora_r}", "model.gradient_checkpointing=true"]
    config = load_config("chat_sft", overrides=[*settings, f"dataset.path={tiny_chat / 'train.jsonl'}"])
    ids = torch.randint(3, 100, (2, 12))
    example = {"input_ids": ids, "labels": ids, "length": torch.tensor([12, 9])}
    assert "val_loss" in check_recipe(config, recipes.load("chat_sft"), example).reported
