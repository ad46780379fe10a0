"""Each DDP practice the service offers as config does what it says.

Two kinds of test: whole runs of a tiny recipe (tests/jobs/tiny.py) through `run()`, compared weight
by weight; and a probe that runs the service's own pieces (`wrap_model`, `Updater`, `WorkerData`)
inside a real Ray Train worker group of 2 (gloo), reporting what it observed. The optimizer, schedule
and clipping rules are plain functions, checked directly.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import ConfigError, TrainSettings, load_config
from raytrain_ddp.optim import Updater, build_optimizer, lr_factor

TINY = str(Path(__file__).parent / "jobs" / "tiny.py")


def _final_weights(workspace, *overrides: str) -> dict[str, torch.Tensor]:
    from raytrain_ddp import run

    summary = run(load_config(TINY, overrides=workspace.overrides(*overrides)))
    return ckpt.open_verified(Path(summary.run_path) / f"epoch_{summary.epochs:04d}").model_state()


def _initial_weights(seed: int = 0, **model) -> dict[str, torch.Tensor]:
    from raytrain_ddp import recipe as recipes

    torch.manual_seed(seed)
    return recipes.load(TINY).build_model(**model).state_dict()


# ---- whole runs -----------------------------------------------------------------------------------

# 16 rows, no shuffle, 3 epochs: each epoch is exactly one optimizer step over all 16 rows, however
# they are divided among workers and micro-batches.
ONE_STEP_AN_EPOCH = (
    "dataset.rows=16",
    "train.shuffle=false",
    "train.epochs=3",
    "train.lr=0.05",
    "checkpoint.num_to_keep=null",
)


@pytest.fixture(scope="module")
def one_worker_batch_16(ray_session, module_workspace):
    return _final_weights(
        module_workspace, *ONE_STEP_AN_EPOCH, "scaling.num_workers=1", "train.batch_size=16", "run.name=one-worker"
    )


def test_two_workers_of_batch_8_train_the_same_weights_as_one_worker_of_batch_16(one_worker_batch_16, workspace):
    """The test that proves gradient synchronisation: DDP averages the workers' gradients."""
    ddp = _final_weights(workspace, *ONE_STEP_AN_EPOCH, "train.batch_size=8")

    torch.testing.assert_close(ddp, one_worker_batch_16, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ddp["body.0.weight"], _initial_weights()["body.0.weight"])  # it did train


def test_accumulating_2_micro_batches_of_4_on_2_workers_equals_one_step_of_16(one_worker_batch_16, workspace):
    accumulated = _final_weights(workspace, *ONE_STEP_AN_EPOCH, "train.batch_size=4", "train.grad_accum_steps=2")

    torch.testing.assert_close(accumulated, one_worker_batch_16, rtol=1e-5, atol=1e-6)


# ---- the service's pieces inside a real worker group --------------------------------------------


def _probe(loop_config: dict) -> None:
    """Runs on each of 2 Ray Train workers; rank 0 writes down everything both ranks observed."""
    import json

    import ray.train
    import torch
    from torch import nn

    from raytrain_ddp import data, loop
    from raytrain_ddp.config import DDPSettings, TrainSettings
    from raytrain_ddp.metrics import all_gather
    from raytrain_ddp.optim import Updater

    seen: dict = {}
    # DDP keyword arguments, as wrap_model passes them.
    ddp = loop.wrap_model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), DDPSettings(**loop_config["ddp"]))
    seen["ddp"] = {
        "find_unused_parameters": ddp.find_unused_parameters,
        "broadcast_buffers": ddp.broadcast_buffers,
        "static_graph": ddp.static_graph,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
    }
    # sync_batchnorm hands DDP SyncBatchNorm layers, which DDP accepts on GPUs only.
    try:
        loop.wrap_model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), DDPSettings(sync_batchnorm=True))
        seen["sync_batchnorm_on_cpu"] = "accepted"
    except ValueError as e:
        seen["sync_batchnorm_on_cpu"] = str(e)

    # Gradient accumulation: count DDP's gradient all-reduces over 8 micro-batches, 4 per step.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = loop.wrap_model(model, DDPSettings())
    allreduces = []

    def counting_hook(state, bucket):
        allreduces.append(1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_hook)
    updater = Updater(
        model, ddp, TrainSettings(grad_accum_steps=4), micro_batches_per_epoch=8, device=torch.device("cpu")
    )
    steps = 0
    for i in range(8):
        with updater.sync(i), updater.autocast():
            loss = ddp(torch.randn(2, 4)).pow(2).mean()
        updater.backward(loss, i)
        if updater.ready(i):
            updater.step()
            steps += 1
    seen["accumulation"] = {"steps": steps, "allreduces": len(allreduces)}

    # bf16 autocast on CPU.
    bf16 = Updater(model, ddp, TrainSettings(precision="bf16"), micro_batches_per_epoch=1, device=torch.device("cpu"))
    with bf16.autocast():
        seen["bf16_output_dtype"] = str(nn.Linear(4, 4)(torch.randn(2, 4)).dtype)

    # The torch Dataset path: which rows each rank gets, per epoch.
    class Indices(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"i": torch.tensor(i)}

    worker_data = data.WorkerData({"train": Indices(21), "val": Indices(15)}, TrainSettings(batch_size=4), seed=7)
    rows = lambda batches: [int(i) for batch in batches for i in batch["i"]]  # noqa: E731
    mine = {
        "epoch0": rows(worker_data.train_batches(0)),
        "epoch1": rows(worker_data.train_batches(1)),
        "epoch0_again": rows(worker_data.train_batches(0)),
        "val": rows(worker_data.val_batches()),
    }
    seen["torch_path"] = all_gather(mine)
    if ray.train.get_context().get_world_rank() == 0:  # a local machine: the test reads the file
        Path(loop_config["out"]).write_text(json.dumps(seen))


DDP_KWARGS = {
    "find_unused_parameters": True,
    "broadcast_buffers": False,
    "static_graph": True,
    "gradient_as_bucket_view": True,
    "bucket_cap_mb": 2.0,
}


@pytest.fixture(scope="module")
def probe(ray_session, tmp_path_factory) -> dict:
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

    root = tmp_path_factory.mktemp("probe")
    trainer = TorchTrainer(
        _probe,
        train_loop_config={"ddp": DDP_KWARGS, "out": str(root / "seen.json")},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name="probe", storage_path=str(root)),
    )
    trainer.fit()
    return json.loads((root / "seen.json").read_text())


def test_ddp_settings_reach_distributed_data_parallel(probe):
    expected = {k: v for k, v in DDP_KWARGS.items() if k != "bucket_cap_mb"}
    assert probe["ddp"] == {**expected, "bucket_bytes_cap": int(2.0 * 1024 * 1024)}


def test_sync_batchnorm_converts_batchnorm_layers_and_keeps_the_checkpoint_keys(probe):
    # DDP received SyncBatchNorm layers: on CPU it refuses them, which is why the config does too.
    assert probe["sync_batchnorm_on_cpu"] == "SyncBatchNorm layers only work with GPU modules"
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    assert sorted(converted.state_dict()) == sorted(model.state_dict())  # checkpoints load into the plain model


def test_sync_batchnorm_and_fp16_on_cpu_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"ddp.sync_batchnorm=true needs GPUs .* set scaling.use_gpu=true"):
        load_config(TINY, overrides=["ddp.sync_batchnorm=true"])
    with pytest.raises(ConfigError, match=r"train.precision=fp16 needs a GPU .* use bf16 or fp32"):
        load_config(TINY, overrides=["train.precision=fp16"])
    assert load_config(TINY, overrides=["ddp.sync_batchnorm=true", "scaling.num_workers=1"]).ddp.sync_batchnorm


def test_accumulation_all_reduces_gradients_only_on_the_last_micro_batch_of_a_step(probe):
    assert probe["accumulation"] == {"steps": 2, "allreduces": 2}  # not 8: no_sync on the other 6


def test_bf16_precision_runs_the_forward_pass_in_bfloat16(probe):
    assert probe["bf16_output_dtype"] == "torch.bfloat16"


def test_torch_dataset_path_splits_reshuffles_per_epoch_and_counts_validation_rows_once(probe):
    rank0, rank1 = probe["torch_path"]
    for epoch in ("epoch0", "epoch1"):
        assert len(rank0[epoch]) == len(rank1[epoch]) == 10  # 21 rows: the same 10 each, one dropped
        assert not set(rank0[epoch]) & set(rank1[epoch])
    assert rank0["epoch0"] != rank0["epoch1"]  # set_epoch reshuffles
    assert rank0["epoch0_again"] == rank0["epoch0"]  # the order is a function of (seed, epoch)
    assert sorted(rank0["val"] + rank1["val"]) == list(range(15))  # no padding, no repeats


def test_ray_data_fetches_are_cut_into_the_configured_batches_in_order():
    from raytrain_ddp.data import split_batches

    rows = torch.arange(13)
    fetched = [
        {"x": rows[:8], "y": -rows[:8]},
        {"x": rows[8:], "y": -rows[8:]},
    ]  # a fetch of 2 batches, then the short last
    kept = list(split_batches(iter(fetched), 4, drop_last=False))
    assert [b["x"].tolist() for b in kept] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]]
    assert all(torch.equal(b["y"], -b["x"]) for b in kept)  # columns cut alike
    dropped = list(split_batches(iter(fetched), 4, drop_last=True))
    assert [b["x"].tolist() for b in dropped] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


# ---- optimizer, schedule, clipping ---------------------------------------------------------------


def test_weight_decay_applies_to_weight_matrices_not_to_biases_or_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, TrainSettings(weight_decay=0.1, lr=0.5))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    # With zero gradients AdamW only decays: weights shrink by (1 - lr * wd), the rest stays.
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    torch.testing.assert_close(model[0].weight, before[0] * (1 - 0.5 * 0.1))
    for p, b in zip(list(model.parameters())[1:], before[1:]):
        torch.testing.assert_close(p, b)


def test_lr_schedules_warm_up_linearly_then_decay():
    cosine = TrainSettings(epochs=2, lr_schedule="cosine", warmup_steps=4)
    factors = [lr_factor(s, cosine, steps_per_epoch=12) for s in range(24)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == 1.0 and factors[12] == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 20)))
    assert all(a > b for a, b in zip(factors[4:], factors[5:])) and lr_factor(24, cosine, 12) == pytest.approx(0)

    step = TrainSettings(epochs=6, lr_schedule="step", lr_step_epochs=2, lr_step_gamma=0.1)
    assert [lr_factor(s, step, steps_per_epoch=5) for s in (0, 9, 10, 19, 20)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])


def test_gradient_clipping_bounds_the_global_norm_of_each_update():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    train = TrainSettings(optimizer="sgd", momentum=0.0, lr=1.0, grad_clip_norm=0.01)
    updater = Updater(model, model, train, micro_batches_per_epoch=1, device=torch.device("cpu"))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    updater.backward((model(torch.randn(32, 8)) * 100).pow(2).mean(), 0)
    norm = updater.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert norm > 1.0  # the gradient was large ...
    assert torch.linalg.vector_norm(after - before) == pytest.approx(0.01, rel=1e-4)  # ... the step is not
