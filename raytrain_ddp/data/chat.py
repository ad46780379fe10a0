"""Rows of fine-tuning data to token ids and labels: the three formats users bring, any chat template.

Formats (a row's fields; `kind` "auto" tells them apart row by row):
- `messages`: `{"messages": [{"role", "content"}, ...]}`; every assistant turn is trained.
- `prompt_completion`: `{"prompt", "completion"}`, both strings (the completion is trained, with the
  end-of-sequence token after it) or both lists of messages (the completion's assistant turns are
  trained; the prompt's, if it has any, are context).
- `text`: `{"text": "..."}`; every token is trained, with the end-of-sequence token after it.

A conversation's trained tokens are each trained assistant turn's content and the end-of-turn token the
chat template puts after it, found in one render of the whole conversation, in this order of preference:
1. the template marks them (`{% generation %}`): the tokenizer's assistant mask;
2. the template renders a conversation's prefix as a prefix of its tokens: the tokens each assistant
   message adds to the render of the conversation before it (its content, end of turn and what follows);
3. otherwise (templates that render an earlier turn unlike the last: another end-of-turn token for the
   final message, reasoning dropped from earlier turns, a date or time in the system block): the
   content's characters located in the render, and the special token that follows it. Where the
   template shortened the content, the longest ending of it that the render holds.
A template none of these can label raises `LabelError`, naming why and the fix.

Packing (`pack`): whole rows, best-fit decreasing, into rows of a fixed number of tokens, each with
position ids that restart at 0 where a row starts: transformers then keeps attention within each
(a block-diagonal causal mask on sdpa and eager, variable-length flash attention on a GPU), so a
packed row trains exactly the tokens, with the same loss, as its rows apart.

Only the tokenizer's public methods are used: this module imports neither transformers nor torch.
"""

from __future__ import annotations

import bisect
import re

import numpy as np

IGNORE = -100  # the label of a token that is not trained (cross_entropy's ignore_index)
ROLES = ("system", "user", "assistant")
KINDS = ("messages", "prompt_completion", "text")
FIX = "mark each assistant turn with {% generation %}...{% endgeneration %} in the tokenizer's chat template"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A probe conversation of every role and two exchanges: a template is checked on it before any data is read.
PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Green."},
    {"role": "user", "content": "And another?"},
    {"role": "assistant", "content": "Blue."},
]


class LabelError(ValueError):
    """The chat template renders a conversation in a way none of the three rules can label."""


def kind_of(row: object, kind: str = "auto") -> str:
    """The row's format: `kind` itself, or (auto) the first of messages, prompt + completion, text it has."""
    if kind != "auto":
        return kind
    if isinstance(row, dict):
        if "messages" in row:
            return "messages"
        if "prompt" in row and "completion" in row:
            return "prompt_completion"
        if "text" in row:
            return "text"
    raise ValueError("the row has none of 'messages', 'prompt' and 'completion', 'text' (dataset.kind=auto)")


def label(row: object, tokenizer, kind: str = "auto") -> tuple[list[int], list[int]]:
    """A row's token ids and labels (the id where trained, IGNORE elsewhere), not yet truncated."""
    kind = kind_of(row, kind)
    if not isinstance(row, dict):
        raise ValueError(f"the row is not an object with the fields of dataset.kind={kind}")
    if kind == "messages":
        messages = row.get("messages")
        check_messages(messages, "'messages'")
        return conversation(messages, _assistants(messages), tokenizer)
    if kind == "text":
        text = row.get("text")
        if not isinstance(text, str) or not text:
            raise ValueError("'text' is missing or not a non-empty string")
        ids = _with_eos(tokenizer(text)["input_ids"], tokenizer)
        return ids, list(ids)
    return _prompt_completion(row.get("prompt"), row.get("completion"), tokenizer)


def _prompt_completion(prompt: object, completion: object, tokenizer) -> tuple[list[int], list[int]]:
    if isinstance(prompt, str) and isinstance(completion, str) and completion:
        context = tokenizer(prompt)["input_ids"]
        answer = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
        return context + answer, [IGNORE] * len(context) + answer
    if isinstance(prompt, list) and isinstance(completion, list):
        check_messages(prompt, "'prompt'", needs_assistant=False)
        check_messages(completion, "'completion'")
        messages = prompt + completion
        return conversation(messages, {k for k in _assistants(messages) if k >= len(prompt)}, tokenizer)
    raise ValueError(
        "'prompt' and 'completion' are not both strings (a non-empty completion) or both lists of messages"
    )


def check_messages(messages: object, field: str, needs_assistant: bool = True) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{field} is missing or not a non-empty list")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            raise ValueError(f"message {j} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {j} ({message['role']}) has content that is not a string")
    if needs_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"no assistant message in {field}")


def check_template(tokenizer) -> str:
    """Which rule labels conversations with this tokenizer's chat template (on PROBE); LabelError if
    none can, or if it has no template."""
    if not tokenizer.chat_template:
        raise LabelError(
            "the tokenizer has no chat template, which conversations need: use a chat (instruct) model, "
            "or rows of 'text' or of plain 'prompt' and 'completion' strings"
        )
    return labelled(PROBE, _assistants(PROBE), tokenizer)[0]


def conversation(messages: list[dict], trained: set[int], tokenizer) -> tuple[list[int], list[int]]:
    """Ids and labels of a conversation whose assistant messages at indices `trained` are trained."""
    return labelled(messages, trained, tokenizer)[1:]


def labelled(messages: list[dict], trained: set[int], tokenizer) -> tuple[str, list[int], list[int]]:
    """(the rule that labelled it: generation, prefix or render; ids; labels)."""
    if not tokenizer.chat_template:
        check_template(tokenizer)  # raises, saying so
    if _GENERATION.search(tokenizer.chat_template):
        return ("generation", *_by_generation_mask(messages, trained, tokenizer))
    if (by_prefix := _by_prefix(messages, trained, tokenizer)) is not None:
        return ("prefix", *by_prefix)
    return ("render", *_by_render(messages, trained, tokenizer))


def _by_generation_mask(messages, trained, tokenizer) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), out["assistant_masks"]
    spans = [(m.start(), m.end()) for m in re.finditer("1+", "".join(map(str, mask)))]
    assistants = sorted(_assistants(messages))
    if len(spans) != len(assistants):
        raise LabelError(
            f"the chat template marks {len(spans)} {{% generation %}} block(s) in a conversation of "
            f"{len(assistants)} assistant message(s): {FIX}, one block for each"
        )
    labels = [IGNORE] * len(ids)
    for (begin, end), k in zip(spans, assistants):
        if k in trained:
            labels[begin:end] = ids[begin:end]
    return ids, labels


def _by_prefix(messages, trained, tokenizer) -> tuple[list[int], list[int]] | None:
    """The tokens each trained assistant message adds to the conversation before it, rendered with the
    generation prompt; None where the template does not render prefixes as prefixes."""

    def render(turns, prompt=False):
        return list(
            tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=prompt, return_dict=False)
        )

    ids = render(messages)
    labels = [IGNORE] * len(ids)
    for k in sorted(trained):
        start, upto = len(render(messages[:k], prompt=True)), render(messages[: k + 1])
        if ids[: len(upto)] != upto or len(upto) <= start:
            return None
        labels[start : len(upto)] = upto[start:]
    return ids, labels


def _by_render(messages, trained, tokenizer) -> tuple[list[int], list[int]]:
    """Each trained assistant content located in the one render of the conversation, by characters,
    and the special token (its end of turn) that follows it, past whitespace."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if not getattr(tokenizer, "is_fast", False):
        raise LabelError(f"the chat template rewrites earlier turns and the tokenizer has no character offsets: {FIX}")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    labels, cursor = [IGNORE] * len(ids), 0
    for k, message in enumerate(messages):
        span = _locate(text, message["content"], cursor)
        if span is None:
            if k in trained:
                raise LabelError(f"the chat template renders assistant message {k} without its content: {FIX}")
            continue
        cursor = span[1]
        if k in trained:
            tokens = [t for t, (b, e) in enumerate(offsets) if b < span[1] and e > span[0]]
            end = _end_of_turn(tokens[-1] + 1, ids, offsets, text, special)
            if end is None:
                raise LabelError(
                    f"the chat template puts no special token after assistant message {k} (a model trained on "
                    f"it would not learn to end its turn): {FIX}"
                )
            labels[tokens[0] : end + 1] = ids[tokens[0] : end + 1]
    return ids, labels


def _locate(text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Where (characters) the render holds `content`, or its longest ending that starts a line or
    follows a closing tag (what a template that drops reasoning keeps), at or after `cursor`."""
    starts = [0, *(m.end() for m in re.finditer(r"\n|>", content))]
    for start in starts:
        piece = content[start:].strip()
        if piece and (at := text.find(piece, cursor)) != -1:
            return at, at + len(piece)
    return None


def _end_of_turn(t: int, ids, offsets, text: str, special: set[int]) -> int | None:
    while t < len(ids) and ids[t] not in special and not text[offsets[t][0] : offsets[t][1]].strip():
        t += 1
    return t if t < len(ids) and ids[t] in special else None


def _assistants(messages: list[dict]) -> set[int]:
    return {k for k, message in enumerate(messages) if message["role"] == "assistant"}


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else list(ids)


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of rows of `lengths` tokens in bins of at most `capacity`: the longest first, each into
    the fullest bin it fits, a new one where none does (ties by index: deterministic)."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
        else:
            space, b = free.pop(k)
            bins[b].append(i)
            bisect.insort(free, (space - lengths[i], b))
    return bins


def pack(rows: dict[str, np.ndarray], capacity: int, pad: int) -> dict[str, np.ndarray]:
    """Rows (`input_ids` and `labels` right-padded, `length`) packed into rows of `capacity` tokens:
    their tokens one after another, `position_ids` from 0 again at each, the first label of each
    IGNORE (its token is not to be predicted from the row before it), padding after the last."""
    bins = best_fit_decreasing([int(n) for n in rows["length"]], capacity)
    ids = np.full((len(bins), capacity), pad, dtype=rows["input_ids"].dtype)
    labels = np.full((len(bins), capacity), IGNORE, dtype=rows["labels"].dtype)
    positions = np.zeros((len(bins), capacity), dtype=np.int32)
    used = np.zeros(len(bins), dtype=np.int32)
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            n = int(rows["length"][i])
            ids[b, at : at + n], labels[b, at : at + n] = rows["input_ids"][i, :n], rows["labels"][i, :n]
            labels[b, at] = IGNORE
            positions[b, at : at + n] = np.arange(n)
            at += n
        positions[b, at:] = np.arange(capacity - at)  # the padding: a sequence of its own
        used[b] = at
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "length": used}
