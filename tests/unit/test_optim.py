"""The update rules the worker loop applies, checked directly: weight decay, LR schedules, gradient
clipping, how micro-batches group into optimizer steps, and the optimizer's fused kernels (and the
benchmark's torchrun side building the same optimizer)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from raytrain_ddp.config.schema import TrainSettings
from raytrain_ddp.worker.optim import Accumulation, Updater, build_optimizer, lr_factor
from raytrain_ddp.worker.step import forward_backward, optimizer_step


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


def _loud(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient is large: a clip bound of 0.01 binds."""
    return (model(x) * 100).pow(2).mean()


def test_gradient_clipping_bounds_the_global_norm_of_each_update():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    train = TrainSettings(optimizer="sgd", momentum=0.0, lr=1.0, grad_clip_norm=0.01)
    updater = Updater(model, train, steps_per_epoch=1, device=torch.device("cpu"))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    forward_backward(model, _loud, torch.randn(32, 8), updater, Accumulation(micro_batches=1, per_step=1), i=0)
    norm = optimizer_step(updater, train.grad_clip_norm)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert norm > 1.0  # the gradient was large ...
    assert torch.linalg.vector_norm(after - before) == pytest.approx(0.01, rel=1e-4)  # ... the step is not


def test_without_clipping_the_norm_is_measured_and_the_update_is_the_optimizers_alone():
    torch.manual_seed(0)
    model, plain = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    plain.load_state_dict(model.state_dict())
    train = TrainSettings(optimizer="sgd", momentum=0.0, lr=1.0, grad_clip_norm=None)
    updater = Updater(model, train, steps_per_epoch=1, device=torch.device("cpu"))
    x = torch.randn(32, 8)
    forward_backward(model, _loud, x, updater, Accumulation(micro_batches=1, per_step=1), i=0)
    _loud(plain, x).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()]))
    torch.optim.SGD(plain.parameters(), lr=1.0).step()

    assert optimizer_step(updater, train.grad_clip_norm) == pytest.approx(expected.item(), rel=1e-5)
    for trained, reference in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(trained, reference)  # unclipped: the large gradient applied as it was


def test_micro_batches_group_into_steps_of_grad_accum_steps_and_the_last_step_takes_the_rest():
    accumulation = Accumulation(micro_batches=7, per_step=3)
    assert [i for i in range(7) if accumulation.ends_step(i)] == [2, 5, 6]
    assert [accumulation.step_size(i) for i in range(7)] == [3, 3, 3, 3, 3, 3, 1]
    assert accumulation.steps == 3


def test_a_summed_loss_steps_by_the_mean_over_all_items_of_the_step_however_micro_batches_split_them():
    """Rows with 1 to 8 valid items each (tokens, say): one step over two micro-batches of uneven item
    counts equals one step over all rows at once; a mean of the two micro-batches' means would not."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8, 4), torch.randn(8, 8)
    valid = torch.arange(8)[None, :] < torch.tensor([1, 1, 1, 1, 8, 8, 8, 7])[:, None]

    def summed(model, rows):
        error = (model(x[rows]).squeeze(-1) - y[rows]).pow(2) * valid[rows]
        return error.sum(), valid[rows].sum()

    def mean(model, rows):
        error, count = summed(model, rows)
        return error / count

    def one_step(loss, micro_batches):
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 1)
        train = TrainSettings(optimizer="sgd", momentum=0.0, lr=0.1, weight_decay=0.0)
        accumulation = Accumulation(micro_batches=len(micro_batches), per_step=len(micro_batches))
        updater = Updater(model, train, steps_per_epoch=1, device=torch.device("cpu"))
        count = 0
        for i, rows in enumerate(micro_batches):
            out = forward_backward(model, loss, rows, updater, accumulation, i)
            count += out[1] if isinstance(out, tuple) else 0
        optimizer_step(updater, None, count if loss is summed else None)
        return model.state_dict()

    whole = one_step(summed, [torch.arange(8)])
    torch.testing.assert_close(one_step(summed, [torch.arange(4), torch.arange(4, 8)]), whole)
    torch.testing.assert_close(one_step(mean, [torch.arange(8)]), whole)  # one batch: the same mean
    with pytest.raises(AssertionError):  # 4 items in the first half, 31 in the second: weighted alike
        torch.testing.assert_close(one_step(mean, [torch.arange(4), torch.arange(4, 8)]), whole)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_optimizer_is_fused_on_cpu_and_a_checkpoint_of_the_default_implementation_resumes_as_it_was(name):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    train = TrainSettings(optimizer=name, weight_decay=0.1)
    optimizer = build_optimizer(model, train)
    assert [group["fused"] for group in optimizer.param_groups] == [True, True]

    # A checkpoint written before fused kernels were chosen: the same groups, torch's default
    # implementation (a loop over the parameters, on CPU).
    default = [{k: v for k, v in group.items() if k not in ("fused", "foreach")} for group in optimizer.param_groups]
    older = type(optimizer)(default)
    model(torch.randn(3, 4)).sum().backward()
    older.step()
    updater = Updater(model, train, steps_per_epoch=1, device=torch.device("cpu"))
    scheduler = updater.scheduler.state_dict()
    updater.load_state_dict({"optimizer": older.state_dict(), "scheduler": scheduler, "scaler": {}})
    updater.optimizer.step()  # loads and steps; the run keeps the implementation it started with
    assert [group["fused"] for group in updater.optimizer.param_groups] == [None, None]


def test_the_benchmarks_torchrun_side_builds_the_services_optimizer():
    path = Path(__file__).parents[2] / "bench" / "torchrun_ddp.py"
    spec = importlib.util.spec_from_file_location("torchrun_ddp", path)
    side_a = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(side_a)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    train = {"optimizer": "adamw", "lr": 3e-4, "weight_decay": 0.1}
    theirs, ours = side_a.build_optimizer(model, train), build_optimizer(model, TrainSettings(**train))
    assert type(theirs) is type(ours)
    assert theirs.state_dict()["param_groups"] == ours.state_dict()["param_groups"]
