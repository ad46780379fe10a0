"""train.compile, checked on the worker loop's own pieces without Ray: the tiny recipe's model compiled
as `wrap_model` compiles it (inductor, for real: g++ builds its CPU kernels), inside DDP in a process
group of one (gloo), trained with accumulation, bf16, dropout, clipping and unused parameters, and
evaluated after every epoch.

One graph per batch shape, compiled once: neither evaluation nor the short last batch recompiles in
later epochs. Checkpoints keep the module's own keys. A run interrupted mid-epoch and resumed in a fresh
compiler (as a restarted worker would be) ends with the uninterrupted run's weights, bit for bit.
(The same resume end to end, on Ray, would cost two more 2-worker runs; this is the part compile
changes.)
"""

from __future__ import annotations

import itertools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config import recipe as recipes
from raytrain_ddp.config.schema import TrainSettings
from raytrain_ddp.worker.optim import Accumulation, Updater
from raytrain_ddp.worker.step import CompiledShapes, compile_for_training, evaluate, forward_backward, optimizer_step

TINY = recipes.load(str(Path(__file__).parents[1] / "jobs" / "tiny.py"))
TRAIN = TrainSettings(
    epochs=3, batch_size=8, grad_accum_steps=2, lr=0.05, grad_clip_norm=1.0, precision="bf16", compile=True
)
ROWS, VAL_ROWS = 28, 22  # per epoch: batches of 8, 8, 8 and a short 4; validation: 16 and a short 6
ACCUMULATION = Accumulation(micro_batches=4, per_step=TRAIN.grad_accum_steps)


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    """DDP needs a process group: one rank, in this process."""
    if not shutil.which(os.environ.get("CXX", "g++")):
        pytest.fail("torch.compile on CPU needs g++: run tests/system-deps.sh (make test does)")
    store = tmp_path_factory.mktemp("process_group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch._dynamo.reset()
    yield
    dist.destroy_process_group()
    torch._dynamo.reset()


@dataclass
class Worker:
    model: torch.nn.Module  # what evaluates and is saved
    ddp_model: torch.nn.Module  # what trains
    updater: Updater


def _worker() -> Worker:
    """As a worker builds it: the model from the seed, then DDP around the compiled model."""
    torch.manual_seed(0)
    model = TINY.build_model(dropout=0.3, unused_branch=True)
    ddp_model = DistributedDataParallel(compile_for_training(model), find_unused_parameters=True)
    return Worker(model, ddp_model, Updater(model, TRAIN, ACCUMULATION.steps, torch.device("cpu")))


def _batches(rows: int, size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """An epoch's batches, in an order set by `seed` (as the service's by seed and epoch)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    return [{"x": x[i : i + size], "y": y[i : i + size]} for i in range(0, rows, size)]


def _train(worker: Worker, epoch: int, first: int = 0, stop: int | None = None, shapes: CompiledShapes | None = None):
    """Micro-batches `first` to `stop` of `epoch`, as the loop trains them (`shapes`: as it tells the
    batches that compile from the rest)."""
    worker.ddp_model.train()
    for i, batch in itertools.islice(enumerate(_batches(ROWS, TRAIN.batch_size, epoch)), first, stop):
        if shapes is not None:
            shapes.new(batch)
        forward_backward(worker.ddp_model, TINY.compute_loss, batch, worker.updater, ACCUMULATION, i)
        if ACCUMULATION.ends_step(i):
            optimizer_step(worker.updater, TRAIN.grad_clip_norm)


def _evaluate(worker: Worker) -> dict:
    with worker.updater.autocast():
        return evaluate(worker.model, TINY, iter(_batches(VAL_ROWS, 16, seed=100)))


def _graphs() -> int:
    """Graphs dynamo has compiled in this process (a recompilation is one more)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def straight():
    """The uninterrupted run: 3 epochs, each evaluated. Returns the worker and the graph count after
    each epoch's training and after its evaluation."""
    torch._dynamo.utils.counters.clear()
    worker = _worker()
    torch.manual_seed(1)  # this rank's random stream: dropout
    graphs, shapes = [], CompiledShapes()
    for epoch in range(TRAIN.epochs):
        _train(worker, epoch, shapes=shapes)
        trained = _graphs()
        metrics = _evaluate(worker)
        graphs.append((trained, _graphs(), len(shapes.seen)))
        assert metrics["samples"] == VAL_ROWS
    return worker, graphs


def test_one_graph_per_batch_shape_compiled_once_and_evaluation_runs_eagerly(straight):
    worker, graphs = straight
    # Epoch 1 compiles the batch of 8 and the short batch of 4; evaluation (eval mode, other
    # shapes) compiles nothing, and no later epoch recompiles anything. The loop's CompiledShapes
    # (whose batches the reported rates leave out) names the same two batches as new, no other.
    assert graphs == [(2, 2, 2)] * TRAIN.epochs
    # Static shapes: a batch of another size gets a graph of its own, so which graph a batch runs
    # through depends on its shape alone, not on the shapes the process saw before (automatic
    # dynamic shapes would have served it from a graph made dynamic by the short batch).
    worker.ddp_model.train()
    with worker.updater.autocast():
        worker.ddp_model(_batches(ROWS, 5, seed=7)[1]["x"]).sum().backward()
    assert _graphs() == 3


def test_checkpoints_keep_the_modules_own_keys(straight, tmp_path):
    worker, _ = straight
    state = ckpt.TrainingState(TRAIN.epochs, 6, worker.updater.state_dict(), [ckpt.rng_state()])
    ckpt.save(tmp_path, model=worker.model, state=state, config={}, metrics={})
    eager = TINY.build_model(dropout=0.3, unused_branch=True).state_dict()
    assert list(ckpt.open_verified(tmp_path).model_state()) == list(eager)  # no `_orig_mod.` prefix


def test_a_compiled_run_resumed_mid_epoch_ends_with_the_uninterrupted_runs_weights(straight, tmp_path):
    straight_worker, _ = straight
    interrupted = _worker()
    torch.manual_seed(1)
    _train(interrupted, epoch=0)
    _evaluate(interrupted)
    _train(interrupted, epoch=1, stop=2)  # one optimizer step into the second epoch, then a checkpoint
    state = ckpt.TrainingState(1, 3, interrupted.updater.state_dict(), [ckpt.rng_state()], batches=2)
    ckpt.save(tmp_path, model=interrupted.model, state=state, config={}, metrics={})

    torch._dynamo.reset()  # a restarted worker compiles again
    resumed = _worker()
    saved = ckpt.open_verified(tmp_path)
    ckpt.load_weights(resumed.model, saved.model_state())
    state = saved.training_state()
    resumed.updater.load_state_dict(state.updater)
    ckpt.set_rng_state(state.rng[0])
    _train(resumed, epoch=1, first=state.batches)
    _evaluate(resumed)
    _train(resumed, epoch=2)

    for name, weight in straight_worker.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], weight), name
    torch.manual_seed(0)
    untrained = TINY.build_model(dropout=0.3, unused_branch=True)
    assert not torch.equal(resumed.model.body[0].weight, untrained.body[0].weight)  # it trained
