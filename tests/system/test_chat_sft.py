"""chat_sft end to end on a real local Ray with 2 workers: LoRA fine-tuning of a tiny Llama-architecture
model (random weights, a tokenizer trained on the conversations: examples/tiny_chat.py) on the formats
users bring (conversations, conversational and plain prompt/completion rows in one JSONL; validation
from Parquet), registration as an MLflow transformers chat model served over HTTP, exact resume of a
worker killed mid-epoch under FSDP2 on packed rows (to DDP's adapters), a damaged adapter checkpoint
skipped, and malformed rows refused. No network: HF_HUB_OFFLINE. (Token-level loss equivalence across
workers and micro-batches: test_ddp.py; which tokens train, for each format and template: unit tier;
full fine-tuning under FSDP2: test_fsdp.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
import torch
from services import BIN, free_port, serve, stop_group, user_env

from raytrain_ddp import ConfigError, load_config
from raytrain_ddp.checkpoint import format as ckpt

FAULTS = str(Path(__file__).parents[1] / "jobs" / "chat_faults.py")
# examples/tiny_chat.py's settings (chat_sft.yaml in its directory): 240 conversations over 2 workers,
# batch 8, 15 steps an epoch, 180 in all; LoRA on every projection and the output layer, with dropout
# (an exact resume restores its randomness too). Here also a checkpoint every 20 steps, all kept, and
# batches grouped by length (the exact resume below holds with them).
CHECKPOINTS = ("checkpoint.every_n_steps=20", "checkpoint.num_to_keep=null", "train.group_by_length=length")


def _run(job: str, workspace, chat: Path, *overrides: str):
    from raytrain_ddp import run

    overrides = workspace.overrides(*CHECKPOINTS, *_formats(chat), *overrides)
    return run(load_config(job, config_file=chat / "chat_sft.yaml", overrides=overrides))


def _formats(chat: Path) -> tuple[str, str]:
    """The tiny chat's data as users bring it: of the training conversations, every fourth from the
    second a conversational prompt/completion row (its last answer the completion), every fourth from
    the fourth a plain one (the prompt rendered with the chat template, as a user's own script would);
    the validation conversations as Parquet, with a column the job does not read. The same tokens train
    as on the conversations, but the earlier answers of a multi-turn prompt/completion row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    train, val = chat / "formats.jsonl", chat / "val.parquet"
    if not train.exists():
        tokenizer = AutoTokenizer.from_pretrained(chat / "model")
        rows = [json.loads(line) for line in (chat / "train.jsonl").read_text().splitlines()]
        for i, row in enumerate(rows):
            prompt, [answer] = row["messages"][:-1], row["messages"][-1:]
            if i % 4 == 1:
                rows[i] = {"prompt": prompt, "completion": [answer]}
            elif i % 4 == 3:
                text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                rows[i] = {"prompt": text, "completion": answer["content"]}
        train.write_text("".join(json.dumps(row) + "\n" for row in rows))
        conversations = [json.loads(line)["messages"] for line in (chat / "val.jsonl").read_text().splitlines()]
        pq.write_table(pa.table({"id": range(len(conversations)), "messages": conversations}), val)
    return f"dataset.path={train}", f"dataset.val_path={val}"


def _fact_prompts(chat: Path, n: int = 8) -> list[tuple[str, str]]:
    """(question, trained answer) of the first `n` one-exchange fact conversations of the training set."""
    rows = [json.loads(line)["messages"] for line in (chat / "train.jsonl").read_text().splitlines()]
    pairs = {m[0]["content"]: m[1]["content"] for m in rows if len(m) == 2 and "Repeat" not in m[0]["content"]}
    return list(pairs.items())[:n]


@pytest.fixture(scope="module")
def straight(ray_session, module_workspace, tiny_chat):
    """The uninterrupted LoRA run the others are compared with."""
    return _run("chat_sft", module_workspace, tiny_chat, "run.name=straight")


def test_lora_fine_tuning_halves_the_assistant_loss_and_trains_only_the_adapters(straight, tiny_chat, record):
    run_dir = Path(straight.run_path)
    first = ckpt.open_verified(run_dir / "epoch_0001").metrics()
    assert straight.final_metrics["val_loss"] < 0.5 * first["val_loss"]
    assert straight.final_metrics["val_perplexity"] == pytest.approx(
        torch.tensor(straight.final_metrics["val_loss"]).exp().item()
    )
    assert first["val_token_accuracy"] < straight.final_metrics["val_token_accuracy"]
    assert straight.final_metrics["tokens_per_s"] > 0

    final = ckpt.open_verified(run_dir / "epoch_0012")
    assert final.config()["ddp"]["find_unused_parameters"] is False  # DDP holds only the adapters: all used
    adapters = final.model_state()
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)  # the base is not saved
    assert all(adapters[name].abs().sum() > 0 for name in adapters if ".lora_B." in name)  # B starts at 0: trained
    lora_bytes = (run_dir / "epoch_0012" / ckpt.MODEL_FILE).stat().st_size
    base_bytes = (tiny_chat / "model" / "model.safetensors").stat().st_size
    assert lora_bytes < base_bytes
    record(
        "chat_sft LoRA run (2 workers, 12 epochs)",
        attempts=straight.attempts,
        resumed="-",
        wasted="-",
        checkpoints=len([p for p in run_dir.iterdir() if p.is_dir()]),
        versions=1,
        note=f"val_loss {first['val_loss']:.2f} -> {straight.final_metrics['val_loss']:.2f}; adapter weights "
        f"{lora_bytes / 1024:.0f} KiB vs base {base_bytes / 1024:.0f} KiB; "
        f"{straight.final_metrics['tokens_per_s']:,.0f} tokens/s",
    )


def test_each_evaluation_logs_the_models_answers_to_validation_prompts(straight):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(straight.tracking_uri)
    table = json.loads(Path(client.download_artifacts(straight.mlflow_run_id, "generated.json")).read_text())
    columns = table["columns"]
    rows = [dict(zip(columns, row)) for row in table["data"]]
    steps = sorted({row["step"] for row in rows})
    assert steps == sorted({15 * epoch for epoch in range(1, 13)} | {20, 40, 80, 100, 140, 160})  # each evaluation
    assert {len([r for r in rows if r["step"] == s]) for s in steps} == {2}
    last = [row for row in rows if row["step"] == steps[-1]]
    assert all(row["prompt"].endswith("<|start|>assistant\n") and row["reference"] for row in last)
    assert client.get_metric_history(straight.mlflow_run_id, "val_perplexity")


def test_the_registered_model_answers_trained_prompts_offline_and_over_http(straight, tiny_chat, tmp_path):
    import mlflow

    assert straight.model.uri == "models:/chat-sft/1"
    mlflow.set_tracking_uri(straight.tracking_uri)
    model = mlflow.pyfunc.load_model(straight.model.uri)
    prompts = _fact_prompts(tiny_chat)
    answers = [_answer(model.predict(_chat_request(question))) for question, _ in prompts]
    right = sum(answer == expected for answer, (_, expected) in zip(answers, prompts))
    assert right >= 5, list(zip(answers, prompts))  # of 8 (greedy; the untrained model: none)

    port = free_port()
    env = user_env({"MLFLOW_TRACKING_URI": straight.tracking_uri, "PATH": f"{BIN}:{user_env()['PATH']}"})
    command = [BIN / "mlflow", "models", "serve", "-m", straight.model.uri, "--env-manager", "local", "-p", str(port)]
    server = serve(command, tmp_path / "serve.log", f"http://127.0.0.1:{port}/ping", env)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps(_chat_request(prompts[0][0])).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            served = json.loads(response.read())
    finally:
        stop_group(server)
    assert _answer(served) == answers[0]


# dataset.packing=bfd (and batches grouped by length): 3 epochs, a checkpoint every 2 steps.
PACKED = ("dataset.packing=bfd", "train.epochs=3", "checkpoint.every_n_steps=2", "mlflow.register=never")


@pytest.fixture(scope="module")
def packed(ray_session, tiny_chat, module_workspace):
    return _run("chat_sft", module_workspace, tiny_chat, *PACKED, "run.name=packed")


def test_lora_under_fsdp_on_packed_rows_resumes_exactly_after_a_worker_is_killed_mid_epoch(
    packed, tiny_chat, workspace, record
):
    """LoRA under FSDP2 (the frozen base and the adapters sharded; each checkpoint the adapters' shards
    alone), packed rows: rank 1 SIGKILLed 3 micro-batches into epoch 2 resumes from that epoch's
    shards and ends with the adapters of the DDP run that was never interrupted, bit for bit (on 2
    ranks FSDP2 trains DDP's weights exactly: test_fsdp.py). (Rows apart under DDP resume as exactly:
    the damaged-checkpoint test below; a worker killed mid-epoch on rows apart: test_reliability.py.)"""
    straight = packed
    per_epoch = int(straight.final_metrics["step"]) // 3
    unpacked = -(-(240 // 2) // 8)  # 240 conversations, 2 workers, 8 rows a batch
    assert 0 < per_epoch < unpacked  # fewer rows, so fewer steps

    log = workspace.root / "packed-faults"
    log.mkdir()
    kill = ("model.kill_rank=1", f"model.kill_at={per_epoch + 3}", f"model.fault_log={log}", "run.max_failures=1")
    faulted = _run(FAULTS, workspace, tiny_chat, *PACKED, *kill, "scaling.strategy=fsdp", "run.name=packed-faulted")

    def settings(summary) -> dict:  # what was trained: everything but the job, the fault, the strategy, where
        config = ckpt.open_verified(Path(summary.run_path) / "epoch_0003").config()
        model = {k: v for k, v in config.pop("model").items() if k not in ("kill_rank", "kill_at", "fault_log")}
        scaling = {k: v for k, v in config.pop("scaling").items() if k != "strategy"}
        return {**{k: v for k, v in config.items() if k not in ("job", "run", "mlflow")}, "model": model, **scaling}

    assert settings(faulted) == settings(straight)
    assert faulted.attempts == 2
    assert "rank 1: the worker process died" in faulted.failures[0]
    resumed = re.search(r"restarted from (epoch_0002-step_(\d+))$", faulted.failures[0])
    assert resumed, faulted.failures[0]
    assert (Path(faulted.run_path) / "epoch_0003" / ckpt.SHARDS_DIR).is_dir()
    final = ckpt.open_verified(Path(faulted.run_path) / "epoch_0003").model_state()
    assert final and all("lora_" in name for name in final)  # the adapters' shards alone
    expected = ckpt.open_verified(Path(straight.run_path) / "epoch_0003").model_state()
    torch.testing.assert_close(final, expected, rtol=0, atol=0)
    record(
        "chat_sft LoRA under FSDP2, packed rows: worker SIGKILLed mid-epoch (max_failures=1)",
        attempts=2,
        resumed=f"{resumed.group(1)} (step {int(resumed.group(2))})",
        wasted=per_epoch + 2 - int(resumed.group(2)),  # its last whole step before the kill, less the resumed one
        checkpoints=len([p for p in Path(faulted.run_path).iterdir() if p.is_dir()]),
        versions="0 (mlflow.register=never); final adapters = DDP's uninterrupted run's, atol=0",
    )


def test_a_damaged_adapter_checkpoint_is_skipped_and_the_run_resumes_exactly(straight, tiny_chat, workspace, record):
    """The newest checkpoint of a copy of the finished run loses a byte: training the run again
    resumes from the one before, trains the last epoch into a directory of its own, with the
    uninterrupted run's weights, and registers that."""
    run_dir = workspace.storage / "straight"
    shutil.copytree(straight.run_path, run_dir)
    data = bytearray((run_dir / "epoch_0012" / ckpt.MODEL_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (run_dir / "epoch_0012" / ckpt.MODEL_FILE).write_bytes(bytes(data))

    resumed = _run("chat_sft", workspace, tiny_chat, "run.name=straight")

    assert resumed.resumed.checkpoint == "epoch_0011"
    assert resumed.resumed.skipped == [
        "epoch_0012: model.pt does not match its checksum (the bytes changed after it was written)"
    ]
    torch.testing.assert_close(
        ckpt.open_verified(run_dir / "epoch_0012-retrained").model_state(),
        ckpt.open_verified(Path(straight.run_path) / "epoch_0012").model_state(),
        rtol=0,
        atol=0,
    )
    best = Path(straight.best_checkpoint).name  # the damaged one is never registered; retrained, it may be
    assert Path(resumed.best_checkpoint).name == ("epoch_0012-retrained" if best == "epoch_0012" else best)
    record(
        "chat_sft LoRA: a flipped byte in the newest (and best) adapter checkpoint",
        attempts=1,
        resumed="epoch_0011 (step 165)",
        wasted=15,
        checkpoints="19 (1 damaged)",
        versions=1,
    )


def test_malformed_rows_of_any_format_are_refused_before_training_with_the_row_named(ray_session, workspace, tiny_chat):
    from raytrain_ddp import run

    bad = workspace.root / "bad.jsonl"
    rows = (tiny_chat / "train.jsonl").read_text().splitlines()[:20]
    rows[3] = json.dumps({"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "no"}]})
    rows[7] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]})
    rows[9] = json.dumps({"prompt": "hi", "completion": [{"role": "assistant", "content": "hello"}]})
    rows[11] = json.dumps({"question": "hi", "answer": "hello"})
    bad.write_text("\n".join(rows) + "\n")
    overrides = workspace.overrides(f"dataset.path={bad}")

    with pytest.raises(ConfigError) as refused:
        run(load_config("chat_sft", config_file=tiny_chat / "chat_sft.yaml", overrides=overrides))

    message = str(refused.value)
    assert "dataset.path: 4 malformed row(s) of 20" in message
    assert "message 0 (user) has content that is not a string: {'messages': [{'role': 'user', 'content': 42}" in message
    assert "message 1 has role 'bot'; roles are system, user, assistant: {'messages': [{'role': 'user'" in message
    assert (
        "'prompt' and 'completion' are not both strings (a non-empty completion) or both lists of messages: " in message
    )
    assert (
        "the row has none of 'messages', 'prompt' and 'completion', 'text' (dataset.kind=auto): {'question'" in message
    )

    import pyarrow as pa
    import pyarrow.parquet as pq

    unknown = workspace.root / "answers.parquet"
    pq.write_table(pa.table({"question": ["hi"], "answer": ["hello"]}), unknown)
    with pytest.raises(ConfigError) as refused:
        run(
            load_config(
                "chat_sft", config_file=tiny_chat / "chat_sft.yaml", overrides=[*overrides, f"dataset.path={unknown}"]
            )
        )
    assert (
        f"dataset.path={unknown}: the Parquet files have columns ['question', 'answer'], not messages or "
        "prompt+completion or text (dataset.kind=auto)" in str(refused.value)
    )
    assert not workspace.storage.exists()


def _chat_request(question: str) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": 24}


def _answer(response) -> str:
    [completion] = response if isinstance(response, list) else [response]
    return completion["choices"][0]["message"]["content"].strip()
