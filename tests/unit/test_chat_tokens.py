"""chat_sft's tokenization: which tokens are trained, what is dropped, what is refused. Checked token by
token against an independent oracle: the character spans of the assistant turns in the rendered text."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow as pa
import pytest

JOBS = Path(__file__).parents[2] / "jobs"
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
    ids, labels = sft.tokenize(CONVERSATION, tokenizer, max_length=512)

    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    assert encoded["input_ids"] == ids  # the oracle tokenizes the same text the same way
    spans = _assistant_spans(text)
    assert len(spans) == 2
    for token, label, (begin, end) in zip(ids, labels, encoded["offset_mapping"]):
        in_assistant = any(b <= begin and end <= e for b, e in spans)
        assert label == (token if in_assistant else sft.IGNORE), (tokenizer.decode([token]), begin, end)
    trained = [i for i, label in zip(ids, labels) if label != sft.IGNORE]
    assert tokenizer.decode(trained) == "Iris likes white.<|end|>\nstone harbor<|end|>\n"


def test_truncation_keeps_the_start_and_a_conversation_with_no_assistant_token_left_is_dropped(sft, tokenizer):
    full_ids, full_labels = sft.tokenize(CONVERSATION, tokenizer, max_length=512)
    first_trained = next(i for i, label in enumerate(full_labels) if label != sft.IGNORE)

    ids, labels = sft.tokenize(CONVERSATION, tokenizer, max_length=first_trained + 2)
    assert ids == full_ids[: first_trained + 2] and labels == full_labels[: first_trained + 2]

    table = pa.table({"messages": [CONVERSATION, CONVERSATION[:3]]})
    out = sft._tokenize_batch(table, tokenizer_path=tokenizer.name_or_path, max_length=first_trained)
    assert list(out["problem"]) == ["dropped", "dropped"]  # only prompt tokens fit: nothing to train
    short = len(sft.tokenize(CONVERSATION[:3], tokenizer, max_length=512)[0])
    assert short < 48 < len(full_ids)
    out = sft._tokenize_batch(table, tokenizer_path=tokenizer.name_or_path, max_length=48)
    assert list(out["problem"]) == ["", ""]
    assert out["input_ids"].shape == (2, 48) and list(out["length"]) == [48, short]
    assert (out["labels"][1, short:] == sft.IGNORE).all()  # padding is never trained
    assert (out["input_ids"][1, short:] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "bot", "content": "hi"}], "message 0 has role 'bot'; roles are system, user, assistant"),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": 4}], "message 0 (user) has content"),
        (None, "'messages' is missing or not a non-empty list"),
        ([{"role": "user", "content": "hello"}], "no assistant message"),
    ],
    ids=["unknown-role", "content-not-text", "no-messages", "no-assistant"],
)
def test_a_malformed_conversation_is_refused_with_the_row_named(sft, tokenizer, messages, says):
    table = pa.table({"messages": pa.array([messages], type=pa.string() if messages is None else None)})
    out = sft._tokenize_batch(table, tokenizer_path=tokenizer.name_or_path, max_length=64)
    [problem] = out["problem"]
    assert problem.startswith(says)
    assert str({"messages": messages})[:40] in problem  # the row itself, to find it in the file
