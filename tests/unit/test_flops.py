"""Model FLOPs and MFU (raytrain_ddp/worker/flops.py), without Ray: a training step's FLOPs counted by torch's
FLOP counter against the closed forms, the peak table looked up by the names torch gives GPUs, and
the utilization arithmetic every report carries."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_ddp.worker.flops import ModelFlops, count, peak_flops, utilization
from raytrain_ddp.worker.metrics import EpochMeter, combine

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _classify(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def test_a_training_step_of_an_mlp_costs_its_matrix_products_forward_and_backward():
    sizes = [(784, 512), (512, 512), (512, 10)]  # the benchmark's MLP
    mlp = nn.Sequential(nn.Linear(*sizes[0]), nn.ReLU(), nn.Linear(*sizes[1]), nn.ReLU(), nn.Linear(*sizes[2]))
    batch = {"x": torch.randn(2, 784), "y": torch.tensor([3, 7])}
    flops = count(_classify, mlp, batch, tokens=None)
    # Per row: forward 2·in·out per layer; backward the same for each weight's gradient and again for
    # each layer's input gradient, but the first's (the data needs none): 6·Σ in·out less 2·784·512.
    products = sum(i * o for i, o in sizes)
    assert flops.per_sample == 6 * products - 2 * 784 * 512 == 3_209_216
    assert flops.per_token is None and flops.known
    assert mlp.training and all(p.grad is None for p in mlp.parameters())  # as a training step leaves it, less grads


def test_torch_2_11s_counter_counts_the_same(monkeypatch):
    """torch 2.11 (the GPU image's) has neither skip_unsupported nor get_unsupported_ops: its counter,
    as that version defines it, gives the same count."""
    import torch.utils.flop_counter as flop_counter

    class Torch211Counter(flop_counter.FlopCounterMode):
        def __init__(self, mods=None, depth=2, display=True, custom_mapping=None):
            super().__init__(mods, depth, display, custom_mapping)

        @property
        def get_unsupported_ops(self):
            raise AttributeError("get_unsupported_ops")

    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    batch = {"x": torch.randn(2, 784), "y": torch.tensor([3, 7])}
    expected = count(_classify, mlp, batch, tokens=None).per_sample
    monkeypatch.setattr(flop_counter, "FlopCounterMode", Torch211Counter)
    assert count(_classify, mlp, batch, tokens=None).per_sample == expected == 6 * 512 * 10 + 4 * 784 * 512


def test_frozen_weights_cost_no_weight_gradient():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mlp[0].requires_grad_(False)  # as LoRA's base
    flops = count(_classify, mlp, {"x": torch.randn(2, 8), "y": torch.tensor([0, 1])}, tokens=None)
    # The first layer: its forward only; the second: no input gradient either, nothing before it trains.
    assert flops.per_sample == 2 * 8 * 16 + 4 * 16 * 4


@pytest.mark.parametrize(
    ("device", "shape", "sequence"),
    [
        ("meta", {"layers": 12, "width": 768, "heads": 12, "vocab": 50304}, 128),  # GPT-2 small
        ("cpu", {"layers": 2, "width": 64, "heads": 4, "vocab": 256}, 32),  # torch's flash attention for CPU
    ],
)
def test_a_decoder_costs_6_flops_per_weight_and_token_plus_attention(device, shape, sequence):
    """The PaLM count the benchmark uses (bench/workload.py), less 6 per bias and norm weight, which
    are no matrix products: on the meta device (as a build_empty_model recipe is counted), where
    attention is two batched products, and on real rows through a fused attention kernel."""
    sys.path.insert(0, str(BENCH))
    try:
        import workload
    finally:
        sys.path.remove(str(BENCH))
    with torch.device(device):
        decoder = workload.Decoder(**shape, context=sequence)
    tokens = torch.randint(0, shape["vocab"], (2, sequence + 1), device=device)
    flops = count(workload.compute_loss, decoder, {"tokens": tokens}, tokens=2 * sequence)
    not_products = sum(p.numel() for name, p in decoder.named_parameters() if name.endswith("bias") or "norm" in name)
    assert flops.per_token == decoder.flops_per_token(sequence) - 6 * not_products
    assert flops.per_sample == flops.per_token * sequence


def test_a_step_the_counter_cannot_count_says_why_and_how_to_count_it():
    class Scale(nn.Module):  # element-wise only: nothing the counter knows
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.weight

    batch = {"x": torch.randn(2, 4), "y": torch.tensor([0, 1])}
    nothing = count(_classify, Scale(), batch, tokens=None)
    assert not nothing.known and "found no matrix product" in nothing.missing and "count_flops(model" in nothing.missing

    def needs_values(model, batch):  # fine on real rows, impossible on a meta model
        return _classify(model, batch) * (model[0].weight.sum() > 0).item()

    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(4, 2))
    failed = count(needs_values, empty, {"x": torch.randn(2, 4, device="meta"), "y": torch.tensor([0, 1])}, None)
    assert not failed.known and "failed on a training step (RuntimeError" in failed.missing
    assert "no model_flops_per_s or MFU" in failed.describe()


def test_the_step_runs_on_an_empty_copy_on_the_meta_device_unless_it_reads_a_value():
    """The driver computes nothing to count (the counter reads shapes): the recipe's step sees a
    meta model and meta rows, and the model's own weights are neither used nor changed. A step that
    needs a value cannot run there, and is counted on the model itself."""
    seen = []
    model = nn.Sequential(nn.Linear(4, 2))
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].device.type))
    weights = model[0].weight.detach().clone()
    batch = {"x": torch.randn(2, 4), "y": torch.tensor([0, 1])}

    assert count(_classify, model, batch, tokens=None).per_sample == 2 * 2 * 4 * 2  # forward, weight gradient
    assert seen == ["meta"] and torch.equal(model[0].weight, weights) and model[0].weight.grad is None

    def needs_values(model, batch):
        return _classify(model, batch) * (model[0].weight.sum() > 0).item()

    assert count(needs_values, model, batch, tokens=None).per_sample == 2 * 2 * 4 * 2
    assert seen == ["meta", "meta", "cpu"]


@pytest.mark.parametrize(
    ("name", "precision", "tf32", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989e12),  # SXM
        ("NVIDIA H100 PCIe", "bf16", False, 756e12),
        ("NVIDIA H100 80GB HBM3", "fp32", False, 67e12),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.5e12),
        ("NVIDIA H200", "fp16", False, 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", False, 312e12),
        ("NVIDIA A100 80GB PCIe", "fp32", False, 19.5e12),
        ("NVIDIA L4", "bf16", False, 121e12),
        ("NVIDIA A10G", "bf16", False, 70e12),
        ("NVIDIA L40S", "bf16", False, None),  # not an L4
        ("NVIDIA A10", "bf16", False, None),  # not an A10G, nor an A100
        ("Tesla T4", "fp16", False, None),
    ],
)
def test_the_peak_is_the_datasheets_dense_figure_for_the_gpu_and_precision(name, precision, tf32, peak):
    assert peak_flops(name, precision, tf32) == peak


def test_mfu_is_the_flops_of_all_workers_over_their_summed_peaks_at_the_slowest_pace():
    metrics = utilization(trained=[4e12, 4e12], busy_s=[2.0, 4.0], peaks=[1e12, 1e12])
    assert metrics == {"model_flops_per_s": 2e12, "mfu": 1.0, "mfu_per_worker": [2.0, 1.0]}
    assert utilization([4e12, 4e12], [2.0, 4.0], [1e12, None]) == {"model_flops_per_s": 2e12}


def test_every_report_of_a_counted_model_carries_its_flops_per_second_and_mfu_only_with_a_peak():
    meter = EpochMeter(samples=100, tokens=3000, compute_s=2.0, data_wait_s=0.5)
    flops = ModelFlops(per_sample=1e9, per_token=2e7, source="counted")
    cpu = torch.device("cpu")
    assert flops.on(cpu, "fp32", rank=0) == flops  # a CPU has no peak
    reported = combine(meter, True, cpu, flops)
    assert reported["model_flops_per_s"] == pytest.approx(3000 * 2e7 / 2.5)  # by tokens, where counted
    assert "mfu" not in reported and "mfu_per_worker" not in reported
    on_gpu = combine(meter, True, cpu, replace(flops, peak=peak_flops("NVIDIA H100 80GB HBM3", "bf16")))
    assert on_gpu["mfu"] == pytest.approx(3000 * 2e7 / 2.5 / 989e12) == on_gpu["mfu_per_worker"][0]
    assert "model_flops_per_s" not in combine(meter, True, cpu, ModelFlops())


def test_the_batches_that_compiled_are_kept_out_of_the_rates_and_mfu():
    """train.compile: an epoch's rates and MFU are the steady step's; the compiler's time is `compile_s`."""
    meter = EpochMeter()
    for i, rows in enumerate(meter.timed([8, 8, 8, 4])):
        if i in (0, 3):  # a new shape each: the first batch and the short last one
            meter.compiling()
            time.sleep(0.2)  # the compiler
        meter.add_batch(torch.tensor(1.0), rows, rows, tokens=10 * rows)
    assert (meter.samples, meter.compile_samples, meter.compile_tokens) == (28, 12, 120)
    assert meter.compile_s >= 0.4 > meter.compute_s

    flops = ModelFlops(per_sample=1e9, per_token=2e7, source="counted", peak=1e12)
    fields = {"samples": 100, "tokens": 3000, "compute_s": 2.0, "data_wait_s": 0.5}
    reported = combine(
        EpochMeter(**fields, compile_s=30.0, compile_samples=10, compile_tokens=300), True, torch.device("cpu"), flops
    )
    assert reported["train_samples"] == 100 and reported["compile_s"] == 30.0
    assert reported["samples_per_s"] == pytest.approx(90 / 2.5)
    assert reported["tokens_per_s"] == pytest.approx(2700 / 2.5)
    assert reported["mfu"] == pytest.approx(2700 * 2e7 / 2.5 / 1e12)
    # An epoch that only compiled (a single batch): its rate over everything, not zero.
    only = EpochMeter(**fields, compile_s=7.5, compile_samples=100, compile_tokens=3000)
    assert combine(only, True, torch.device("cpu"), flops)["samples_per_s"] == pytest.approx(100 / 10.0)
