"""scaling.strategy=fsdp (FSDP2) end to end on a real local Ray with 2 workers (gloo): full fine-tuning
of the tiny chat model (examples/tiny_chat.py) sharded, a worker SIGKILLed mid-epoch, trains DDP's
weights bit for bit, each worker holding half of the state; its checkpoints are every rank's shards;
a damaged shard is skipped; the run resumed on one worker reshards them, then registers the whole
model assembled from them, which answers. (LoRA under FSDP2: test_chat_sft.py; the MLP, resharded:
test_ddp.py; shards on S3: test_s3.py; the refusals: the unit tier.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from raytrain_ddp import load_config
from raytrain_ddp.checkpoint import format as ckpt

FAULTS = str(Path(__file__).parents[1] / "jobs" / "chat_faults.py")
# examples/tiny_chat.py's settings (240 conversations, 2 workers, batch 8: 15 steps an epoch), every
# parameter trained, 2 epochs, a checkpoint every 10 steps (steps 10, 15 | 20, 30), all kept.
FULL = (
    "model.lora_r=0",
    "train.epochs=2",
    "checkpoint.every_n_steps=10",
    "checkpoint.num_to_keep=null",
    "mlflow.register=never",
)
SHARDS = {f"{ckpt.SHARDS_DIR}/{name}" for name in (".metadata", "__0_0.distcp", "__1_0.distcp")}


def _run(job: str, workspace, chat: Path, *overrides: str):
    from raytrain_ddp import run

    overrides = workspace.overrides(*FULL, *overrides)
    return run(load_config(job, config_file=chat / "chat_sft.yaml", overrides=overrides))


def _weights(summary, name: str = "epoch_0002") -> dict[str, torch.Tensor]:
    return ckpt.open_verified(Path(summary.run_path) / name).model_state()


@pytest.fixture(scope="module")
def replicated(ray_session, module_workspace, tiny_chat):
    """The same run under DDP, never interrupted."""
    return _run("chat_sft", module_workspace, tiny_chat, "run.name=replicated")


# Rank 1 SIGKILLed at its 23rd micro-batch, 3 steps after the step-20 checkpoint.
KILL = ("scaling.strategy=fsdp", "model.kill_rank=1", "model.kill_at=23", "run.max_failures=1", "run.name=sharded")


@pytest.fixture(scope="module")
def sharded(ray_session, module_workspace, tiny_chat):
    log = module_workspace.root / "faults"
    log.mkdir()
    return _run(FAULTS, module_workspace, tiny_chat, *KILL, f"model.fault_log={log}"), log


def test_fsdp_killed_mid_epoch_resumes_from_every_ranks_shards_to_ddps_weights_bit_for_bit_with_half_the_state(
    sharded, replicated, record
):
    """On 2 ranks FSDP2's reduce-scatter sums the same two halves DDP's all-reduce does, and AdamW updates
    each element alike, shard or whole: FSDP2 trains DDP's weights bit for bit. A resume from the
    shards that were not exact would not."""
    sharded, _ = sharded
    assert sharded.attempts == 2
    assert "rank 1: the worker process died" in sharded.failures[0]
    assert sharded.failures[0].endswith("restarted from epoch_0002-step_0000020"), sharded.failures[0]
    final = Path(sharded.run_path) / "epoch_0002"
    listed = json.loads((final / ckpt.MANIFEST_FILE).read_text())["files"]
    assert {name for name in listed if name.startswith(ckpt.SHARDS_DIR)} == SHARDS  # each rank's, and DCP's index
    assert not (final / ckpt.MODEL_FILE).exists()
    weights = _weights(sharded)
    torch.testing.assert_close(weights, _weights(replicated), rtol=0, atol=0)
    assert sharded.final_metrics["train_loss"] == replicated.final_metrics["train_loss"]
    earlier = ckpt.open_verified(final.parent / "epoch_0001-step_0000010").model_state()
    assert all(not torch.equal(weights[name], earlier[name]) for name in weights)  # every parameter trains

    whole, half = replicated.final_metrics["model_state_mb"], sharded.final_metrics["model_state_mb"]
    print(f"parameters + gradients + AdamW state per worker: DDP {whole:.3f} MB, FSDP2 on 2 workers {half:.3f} MB")
    assert 0.45 < half / whole < 0.55
    record(
        "chat_sft full fine-tuning under FSDP2: rank 1 SIGKILLed at step 23 (max_failures=1)",
        attempts=2,
        resumed="epoch_0002-step_0000020 (step 20), every rank's shards",
        wasted=2,
        checkpoints=len([p for p in Path(sharded.run_path).iterdir() if p.name.startswith("epoch_")]),
        versions="0 (mlflow.register=never); final weights = DDP's uninterrupted run's, atol=0",
    )


def test_a_damaged_shard_is_skipped_and_the_run_resumed_on_one_worker_reshards_and_registers_the_whole_model(
    sharded, workspace, tiny_chat
):
    """A copy of the finished run, its newest checkpoint's rank-1 shard a byte changed, trained to a
    third epoch on one worker (its global batch kept: 2 micro-batches a step): the damaged checkpoint
    is skipped, and so is the mid-epoch one before it (a position in the data of 2 workers), so DCP
    reshards epoch 1's two ranks' shards onto one. The registered model is the whole model, assembled
    from the last checkpoint's shards, and answers as a chat model."""
    import mlflow

    sharded, log = sharded
    run_dir = workspace.storage / "sharded"
    shutil.copytree(sharded.run_path, run_dir)
    shard = run_dir / "epoch_0002" / ckpt.SHARDS_DIR / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    resumed = _run(
        FAULTS,  # the run's own job (its fault spent)
        workspace,
        tiny_chat,
        *KILL,
        f"model.fault_log={log}",
        "scaling.num_workers=1",
        "train.grad_accum_steps=2",
        "train.epochs=3",
        "mlflow.register=always",
    )
    assert resumed.resumed.checkpoint == "epoch_0001"
    assert resumed.resumed.skipped == [
        "epoch_0002: shards/__1_0.distcp does not match its checksum (the bytes changed after it was written)",
        "epoch_0002-step_0000020: mid-epoch, a position in the data of 2 workers, not 1",
    ]
    listed = json.loads((run_dir / "epoch_0003" / ckpt.MANIFEST_FILE).read_text())["files"]
    assert {name for name in listed if name.startswith(ckpt.SHARDS_DIR)} == SHARDS - {"shards/__1_0.distcp"}
    assert (run_dir / "epoch_0002-retrained" / ckpt.MANIFEST_FILE).exists()

    mlflow.set_tracking_uri(resumed.tracking_uri)
    registered = mlflow.transformers.load_model(resumed.model.uri, return_type="components")["model"]
    expected = ckpt.open_verified(run_dir / "epoch_0003").model_state()
    torch.testing.assert_close({name: registered.state_dict()[name] for name in expected}, expected)
    answer = mlflow.pyfunc.load_model(resumed.model.uri).predict(
        {"messages": [{"role": "user", "content": "What is Ada's favourite colour?"}], "max_tokens": 8}
    )
    [completion] = answer if isinstance(answer, list) else [answer]
    assert completion["choices"][0]["message"]["content"].strip()
