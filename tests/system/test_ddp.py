"""Each DDP practice the service offers as config does what it says.

Two kinds of test: whole runs of a tiny recipe (tests/jobs/tiny.py) through `run()`, compared weight
by weight; and a probe that runs the service's own pieces (`wrap_model`, a training step, `WorkerData`)
inside a real Ray Train worker group of 2 (gloo), reporting what it observed. (The optimizer, schedule
and clipping rules are plain functions, checked directly in tests/unit/test_optim.py.)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config.layering import load_config

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


def _run(workspace, *overrides: str):
    from raytrain_ddp import run

    return run(load_config(TINY, overrides=workspace.overrides(*overrides)))


def _weights(summary) -> dict[str, torch.Tensor]:
    return ckpt.open_verified(Path(summary.run_path) / f"epoch_{summary.epochs:04d}").model_state()


def _final_weights(workspace, *overrides: str) -> dict[str, torch.Tensor]:
    return _weights(_run(workspace, *overrides))


def _initial_weights(seed: int = 0, **model) -> dict[str, torch.Tensor]:
    from raytrain_ddp.config import recipe as recipes

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
    "mlflow.register=never",  # the weights are compared, not a model
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


def test_fsdp_on_2_workers_trains_what_one_worker_trains_and_its_shards_reshard_onto_1_worker(
    one_worker_batch_16, workspace
):
    """scaling.strategy=fsdp: 2 epochs on 2 workers, each writing its own shards; then the run resumed on
    1 worker (2 micro-batches a step: the global batch kept) for epoch 3, DCP resharding the two ranks'
    shards onto one. The weights are one worker's of batch 16 after 3 epochs."""
    sharded = ("scaling.strategy=fsdp", "train.batch_size=8", "run.name=sharded")
    _run(workspace, *ONE_STEP_AN_EPOCH, *sharded, "train.epochs=2")
    resumed = _run(workspace, *ONE_STEP_AN_EPOCH, *sharded, "scaling.num_workers=1", "train.grad_accum_steps=2")

    assert resumed.resumed.checkpoint == "epoch_0002"
    run_dir = Path(resumed.run_path)
    shards = {
        n: sorted(p.name for p in (run_dir / n / ckpt.SHARDS_DIR).iterdir()) for n in ("epoch_0002", "epoch_0003")
    }
    assert shards == {
        "epoch_0002": [".metadata", "__0_0.distcp", "__1_0.distcp"],
        "epoch_0003": [".metadata", "__0_0.distcp"],
    }
    torch.testing.assert_close(_weights(resumed), one_worker_batch_16, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def lazy_accumulated(ray_session, module_workspace, tmp_path_factory):
    """2 workers, micro-batches of 4 accumulated 2 at a time, read through Ray Train's Ray Data path (a
    lazy dataset): each of its Ray Data tasks notes its time and process in `<tasks>/<dataset>.pids`."""
    tasks = tmp_path_factory.mktemp("tasks")
    overrides = ("train.batch_size=4", "train.grad_accum_steps=2", "dataset.source=lazy-ray", f"dataset.path={tasks}")
    return _run(module_workspace, *ONE_STEP_AN_EPOCH, *overrides), tasks


def test_accumulating_2_micro_batches_of_4_on_2_workers_equals_one_step_of_16(one_worker_batch_16, lazy_accumulated):
    summary, _ = lazy_accumulated  # the same rows make the same step

    torch.testing.assert_close(_weights(summary), one_worker_batch_16, rtol=1e-5, atol=1e-6)


def test_a_lazy_datasets_later_epochs_run_its_tasks_in_the_processes_of_its_first(lazy_accumulated):
    """Ray ends a worker process idle for a second where a node runs more processes than it has CPUs
    (Ray Train's actors do, here): each epoch then started its Ray Data tasks' processes anew, seconds
    an epoch. The service's own Ray keeps them a minute (session.OWN_RAY), as does this session's."""
    summary, tasks = lazy_accumulated
    first_epoch_done = (Path(summary.run_path) / "epoch_0001" / ckpt.MANIFEST_FILE).stat().st_mtime
    for name in ("train", "val"):
        noted = [line.split() for line in (tasks / f"{name}.pids").read_text().splitlines()]
        first = {pid for at, pid in noted if float(at) < first_epoch_done}
        later = {pid for at, pid in noted if float(at) > first_epoch_done}
        assert later and later <= first, (name, first, later)


# ---- the service's pieces inside a real worker group --------------------------------------------


def _probe(loop_config: dict) -> None:
    """Runs on each of 2 Ray Train workers; rank 0 writes down everything both ranks observed."""
    import json

    import ray.train
    import torch
    from torch import nn

    from raytrain_ddp.config.schema import DataSettings, DDPSettings, TrainSettings
    from raytrain_ddp.data import datasets as data
    from raytrain_ddp.worker import step as training
    from raytrain_ddp.worker.metrics import all_gather
    from raytrain_ddp.worker.optim import Accumulation, Updater

    seen: dict = {}
    # DDP keyword arguments, as wrap_model passes them.
    ddp = training.wrap_model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), DDPSettings(**loop_config["ddp"]))
    seen["ddp"] = {
        "find_unused_parameters": ddp.find_unused_parameters,
        "broadcast_buffers": ddp.broadcast_buffers,
        "static_graph": ddp.static_graph,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
    }
    # sync_batchnorm hands DDP SyncBatchNorm layers, which DDP accepts on GPUs only.
    try:
        training.wrap_model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), DDPSettings(sync_batchnorm=True))
        seen["sync_batchnorm_on_cpu"] = "accepted"
    except ValueError as e:
        seen["sync_batchnorm_on_cpu"] = str(e)

    # Gradient accumulation: count DDP's gradient all-reduces over 8 micro-batches, 4 per step.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = training.wrap_model(model, DDPSettings())
    allreduces = []

    def counting_hook(state, bucket):
        allreduces.append(1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_hook)
    accumulation = Accumulation(micro_batches=8, per_step=4)
    updater = Updater(model, TrainSettings(grad_accum_steps=4), accumulation.steps, device=torch.device("cpu"))
    squared = lambda ddp_model, x: ddp_model(x).pow(2).mean()  # noqa: E731
    steps = 0
    for i in range(8):  # as the loop trains a micro-batch, and steps
        training.forward_backward(ddp, squared, torch.randn(2, 4), updater, accumulation, i)
        if accumulation.ends_step(i):
            training.optimizer_step(updater, clip_norm=None)
            steps += 1
    seen["accumulation"] = {"steps": steps, "allreduces": len(allreduces)}

    # bf16 autocast on CPU.
    bf16 = Updater(model, TrainSettings(precision="bf16"), steps_per_epoch=1, device=torch.device("cpu"))
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

    shipped = {"train": Indices(21), "val": Indices(15)}
    worker_data = data.WorkerData(shipped, TrainSettings(batch_size=4), DataSettings(), seed=7)
    rows = lambda batches: [int(i) for batch in batches for i in batch["i"]]  # noqa: E731
    mine = {
        "epoch0": rows(worker_data.train_batches(0)),
        "epoch1": rows(worker_data.train_batches(1)),
        "epoch0_again": rows(worker_data.train_batches(0)),
        "val": rows(worker_data.val_batches()),
    }
    seen["torch_path"] = all_gather(mine)

    # A materialized Ray Dataset's blocks (of uneven sizes), read by each rank itself.
    blocks = data.WorkerData(
        loop_config["blocks"], TrainSettings(batch_size=4, local_shuffle_buffer_size=8), DataSettings(), seed=7
    )
    mine = {
        "epoch0": rows(blocks.train_batches(0)),
        "epoch0_from_batch_1": rows(blocks.train_batches(0, first=1)),
        "epoch1": rows(blocks.train_batches(1)),
        "epoch0_again": rows(blocks.train_batches(0)),
        "val": rows(blocks.val_batches()),
        "reads_files": blocks.reads_files,
    }
    seen["blocks_path"] = all_gather(mine)

    # chat_sft's token-summed loss, full fine-tuning: one step of 2 ranks x 4 conversations, one of 2
    # ranks x 2 micro-batches x 2, and one of 2 ranks x their 4 packed into rows (dataset.packing=bfd);
    # the test compares each with one worker's step over all 8, a row each.
    rank = ray.train.get_context().get_world_rank()
    rows = torch.arange(rank * 4, rank * 4 + 4)
    steps = {
        "ddp": _chat_step(loop_config["chat"], [rows], ddp=True),
        "ddp_accumulated": _chat_step(loop_config["chat"], [rows[:2], rows[2:]], ddp=True),
        "ddp_packed": _chat_step(loop_config["chat"], [rows], ddp=True, packed=True),
    }
    if rank == 0:  # a local machine: the test reads the files
        Path(loop_config["out"]).write_text(json.dumps(seen))
        torch.save(steps, Path(loop_config["out"]).with_name("chat_steps.pt"))


def _chat_step(chat_dir: str, micro_batches: list, ddp: bool = False, packed: bool = False) -> dict:
    """One SGD step of chat_sft's tiny model (every weight trains) over the first 8 training
    conversations, taken as `micro_batches` (row indices), each packed into rows of 128 tokens if
    `packed`, by the service's forward_backward and optimizer_step; returns the weights after it."""
    import importlib.util

    from raytrain_ddp.config.schema import DDPSettings, TrainSettings
    from raytrain_ddp.data import chat
    from raytrain_ddp.worker import step as training
    from raytrain_ddp.worker.optim import Accumulation, Updater

    spec = importlib.util.spec_from_file_location("chat_sft_probe", Path(__file__).parents[2] / "jobs" / "chat_sft.py")
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    tokenizer = sft._tokenizer(f"{chat_dir}/model")
    conversations = [json.loads(line) for line in Path(chat_dir, "train.jsonl").read_text().splitlines()[:8]]
    encoded = [sft.tokenize(c, tokenizer, max_length=128) for c in conversations]
    batch = {
        "input_ids": torch.full((8, 128), tokenizer.pad_token_id),
        "labels": torch.full((8, 128), sft.IGNORE),
        "length": torch.tensor([len(ids) for ids, _ in encoded]),
    }
    for i, (ids, labels) in enumerate(encoded):
        batch["input_ids"][i, : len(ids)], batch["labels"][i, : len(ids)] = torch.tensor(ids), torch.tensor(labels)
    model = sft.build_model(path=f"{chat_dir}/model", lora_r=0)
    trained = training.wrap_model(model, DDPSettings()) if ddp else model
    train = TrainSettings(optimizer="sgd", momentum=0.0, lr=0.5, weight_decay=0.0)
    accumulation = Accumulation(micro_batches=len(micro_batches), per_step=len(micro_batches))
    updater = Updater(model, train, steps_per_epoch=1, device=torch.device("cpu"))
    count = 0
    for i, rows in enumerate(micro_batches):
        part = {name: column[rows] for name, column in batch.items()}
        if packed:
            rows_apart = {name: column.numpy() for name, column in part.items()}
            part = {k: torch.from_numpy(v) for k, v in chat.pack(rows_apart, 128, tokenizer.pad_token_id).items()}
        count = count + training.forward_backward(trained, sft.compute_loss, part, updater, accumulation, i)[1]
    training.optimizer_step(updater, None, count)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


DDP_KWARGS = {
    "find_unused_parameters": True,
    "broadcast_buffers": False,
    "static_graph": True,
    "gradient_as_bucket_view": True,
    "bucket_cap_mb": 2.0,
}


@pytest.fixture(scope="module")
def probe(ray_session, tmp_path_factory, tiny_chat) -> dict:
    import numpy as np
    import pyarrow as pa
    import ray.cloudpickle
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_ddp.data import datasets as data

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

    root = tmp_path_factory.mktemp("probe")
    # 21 training rows in blocks of 5, 7 and 9 rows; 15 to validate in blocks of 6 and 9.
    column = lambda first, n: pa.table({"i": np.arange(first, first + n)})  # noqa: E731
    train = ray.data.from_blocks([column(0, 5), column(5, 7), column(12, 9)]).materialize()
    val = ray.data.from_blocks([column(0, 6), column(6, 9)]).materialize()
    shipped = data.shipped({"train": train, "val": val})
    trainer = TorchTrainer(
        _probe,
        train_loop_config={
            "ddp": DDP_KWARGS,
            "out": str(root / "seen.json"),
            "chat": str(tiny_chat),
            "blocks": shipped,
        },
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name="probe", storage_path=str(root)),
    )
    trainer.fit()
    return {**json.loads((root / "seen.json").read_text()), "chat_steps": torch.load(root / "chat_steps.pt")}


def test_ddp_settings_reach_distributed_data_parallel(probe):
    expected = {k: v for k, v in DDP_KWARGS.items() if k != "bucket_cap_mb"}
    assert probe["ddp"] == {**expected, "bucket_bytes_cap": int(2.0 * 1024 * 1024)}


def test_sync_batchnorm_converts_batchnorm_layers_and_keeps_the_checkpoint_keys(probe):
    # DDP received SyncBatchNorm layers: on CPU it refuses them, which is why the config does too.
    assert probe["sync_batchnorm_on_cpu"] == "SyncBatchNorm layers only work with GPU modules"
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    assert sorted(converted.state_dict()) == sorted(model.state_dict())  # checkpoints load into the plain model


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


def test_a_materialized_ray_dataset_is_read_by_each_rank_from_its_blocks_and_resumes_mid_epoch(probe):
    """Equal disjoint shares (21 rows: 10 each), a new order each epoch, a function of (seed, epoch);
    a resumed epoch's batches are the uninterrupted epoch's; validation counts each row once."""
    rank0, rank1 = probe["blocks_path"]
    for epoch in ("epoch0", "epoch1"):
        assert len(rank0[epoch]) == len(rank1[epoch]) == 10
        assert not set(rank0[epoch]) & set(rank1[epoch]) and set(rank0[epoch]) | set(rank1[epoch]) <= set(range(21))
    assert rank0["epoch0"] != rank0["epoch1"] and rank0["epoch0_again"] == rank0["epoch0"]
    for rank in (rank0, rank1):
        assert rank["epoch0_from_batch_1"] == rank["epoch0"][4:]
        assert rank["reads_files"] is False  # no file to skip: no data_bad_files in its reports
    assert sorted(rank0["val"] + rank1["val"]) == list(range(15))


def test_a_materialized_datasets_blocks_are_listed_without_executing_it(ray_session):
    """From its plan's source: Ray Data's execution would start its executor and create the cluster's
    stats actor (one more process while a run starts). A lazy dataset is not listed."""
    import numpy as np
    import pyarrow as pa
    import ray.data

    from raytrain_ddp.data.stream import Blocks

    column = lambda first, n: pa.table({"i": np.arange(first, first + n)})  # noqa: E731
    for dataset in (
        ray.data.from_blocks([column(0, 5), column(5, 7)]),
        ray.data.from_numpy(np.arange(12)),
        ray.data.range(12, override_num_blocks=3).materialize(),
    ):
        runs = dataset._run_index  # Ray Data counts its executors per dataset
        blocks = Blocks.of(dataset)
        assert blocks is not None and blocks.manifest.total == 12
        first_row = blocks.read(blocks.manifest.files[0], 0, 1, 0)
        assert next(iter(first_row.values()))[0] == 0
        assert dataset._run_index == runs
    assert Blocks.of(ray.data.range(12)) is None


def test_a_token_summed_loss_steps_on_2_workers_accumulated_or_packed_as_1_worker_on_all_rows(probe, tiny_chat):
    """Conversations of different lengths: the step is the mean over every trained token of the global
    batch, not a mean of per-worker or per-micro-batch means; packed into rows, the same step."""
    one_worker = _chat_step(str(tiny_chat), [torch.arange(8)])
    torch.testing.assert_close(probe["chat_steps"]["ddp"], one_worker, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probe["chat_steps"]["ddp_accumulated"], one_worker, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probe["chat_steps"]["ddp_packed"], one_worker, rtol=1e-5, atol=1e-5)
    untrained = _chat_step(str(tiny_chat), [])  # no micro-batch: the weights as loaded
    assert all(not torch.equal(one_worker[name], untrained[name]) for name in one_worker)  # full: every weight
