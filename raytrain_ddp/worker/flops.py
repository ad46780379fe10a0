"""Model FLOPs utilization (MFU): what one training step of the model costs, counted once on the
driver, against the most the workers' devices can do.

FLOPs of a training step. For a run on GPUs, pre-flight counts one step, forward and backward, on
the two example rows with torch's FLOP counter (`torch.utils.flop_counter.FlopCounterMode`), once the
recipe has passed its checks (`count`): the FLOPs of the matrix products, convolutions and attention
it knows, from their shapes; element-wise work (norms, activations, the optimizer) is left out, as in
the usual 6 x parameters estimate. Attention's backward counts twice its forward (the gradients of
its two products) whichever kernel the driver's torch picks: flash attention's recomputation of the
scores, which torch's own formula adds, is the kernel's cost, not the model's. Divided by the rows
that is FLOPs per sample; for a recipe that counts tokens also by their tokens, FLOPs per token,
which prices batches of any length. The step is counted as it runs: weights that do not train
(LoRA's base) cost no weight gradient, and activation checkpointing's recomputation is counted (the
figure is then hardware, not model, FLOPs).

It costs the driver next to no compute: the step runs on a copy of the model on the meta device
(a step that reads a value cannot: it then runs on the model itself, a forward and a backward on two
rows), and, the counter's first time in a process, about a second: torch imports its compiler
(torch._dynamo) for it. So a CPU run, which has no peak to hold FLOPs against, counts nothing. A model
the counter cannot count (an op it does not know counts 0; a step that needs real values, on a meta
model) is said so once, in the plan, and reports no FLOPs. A recipe can give the count instead,
`count_flops(model, batch)`: it is used on any device, and nothing is counted.

The peak. Each worker looks its GPU up by the name torch gives it (`torch.cuda.get_device_name`) in
`PEAKS`: the vendors' dense figures (no sparsity) for the run's precision. A CPU has no peak, nor has
a GPU not in the table: the run then reports no MFU, and rank 0 says why in its log, once.

What every report carries (metrics.combine), when the FLOPs are known: `model_flops_per_s`, the
model FLOPs of all workers over the slowest one's busy time (as `samples_per_s`); and, where every
worker's peak is known, `mfu` (that over the sum of the workers' peaks) and `mfu_per_worker` (each
rank's FLOPs over its own busy time, over its peak).
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

logger = logging.getLogger(__name__)

HOOK = "count_flops(model, batch)"


@dataclass(frozen=True)
class Peak:
    """A device's dense peak, FLOP/s."""

    bf16: float  # 16-bit tensor cores (fp16's figure is the same on every GPU below)
    tf32: float  # fp32 matrix products on tensor cores, when torch allows it
    fp32: float


# The words of the name torch gives a GPU (all of them; the first entry that matches wins) -> its
# dense peak, from the vendors' datasheets (their "with sparsity" figures are twice these). H100 and
# H200 without PCIe/NVL are the SXM parts. NVIDIA publishes no datasheet of the A10G (AWS G5): its
# figures are derived from 80 SMs at 1.71 GHz with GA102's consumer-rate tensor cores (the 70 TFLOP/s
# bf16 commonly cited, half the A10's rate per SM).
PEAKS: tuple[tuple[tuple[str, ...], Peak], ...] = (
    (("H100", "PCIE"), Peak(bf16=756e12, tf32=378e12, fp32=51e12)),
    (("H100", "NVL"), Peak(bf16=835e12, tf32=417.5e12, fp32=60e12)),
    (("H100",), Peak(bf16=989e12, tf32=494.5e12, fp32=67e12)),
    (("H200", "NVL"), Peak(bf16=835e12, tf32=417.5e12, fp32=60e12)),
    (("H200",), Peak(bf16=989e12, tf32=494.5e12, fp32=67e12)),
    (("A100",), Peak(bf16=312e12, tf32=156e12, fp32=19.5e12)),
    (("L4",), Peak(bf16=121e12, tf32=60e12, fp32=30.3e12)),
    (("A10G",), Peak(bf16=70e12, tf32=35e12, fp32=35e12)),
)


def peak_flops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of the GPU named `device_name` (as torch.cuda.get_device_name says it)
    at `precision` (train.precision; fp32 with `tf32`: matrix products on TF32 tensor cores), or None
    for a device not in PEAKS. Whole words match: an L40S is no L4, an A100 no A10G."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    peak = next((peak for named, peak in PEAKS if words.issuperset(named)), None)
    if peak is None:
        return None
    if precision in ("bf16", "fp16"):
        return peak.bf16
    return peak.tf32 if tf32 else peak.fp32


@dataclass(frozen=True)
class ModelFlops:
    """What one training step costs (decided on the driver) and, on a worker, its device's peak."""

    per_sample: float | None = None  # FLOPs of a training step, forward and backward, per row
    per_token: float | None = None  # the same per token, for a recipe that counts tokens
    source: str = ""  # how they were found
    missing: str = "not counted"  # why there are none, when there are none
    peak: float | None = None  # on a worker (`on`): its device's dense peak FLOP/s at the run's precision

    @classmethod
    def of_step(cls, flops: float, rows: int, tokens: int | None, source: str) -> ModelFlops:
        return cls(flops / rows, flops / tokens if tokens else None, source)

    @property
    def known(self) -> bool:
        return self.per_sample is not None

    def trained(self, samples: int, tokens: int) -> float:
        """The FLOPs of training `samples` rows holding `tokens` tokens: by tokens where they are counted."""
        return self.per_token * tokens if self.per_token is not None else self.per_sample * samples

    def params(self) -> dict[str, str]:
        """For the MLflow run's params."""
        counts = {"model_flops_per_sample": self.per_sample, "model_flops_per_token": self.per_token}
        return {key: f"{value:.6g}" for key, value in counts.items() if value is not None}

    def describe(self) -> str:
        """A line for the plan."""
        if not self.known:
            return f"model FLOPs unknown, so no model_flops_per_s or MFU is reported: {self.missing}"
        token = f", {si(self.per_token)}FLOP per token" if self.per_token is not None else ""
        return f"model FLOPs: {si(self.per_sample)}FLOP per sample{token} (forward + backward, {self.source})"

    def on(self, device: torch.device, precision: str, rank: int) -> ModelFlops:
        """These FLOPs on a worker, with its device's peak (CPU: none). Rank 0 says once why a GPU
        it runs on gives no MFU."""
        if not self.known or device.type != "cuda":
            return self
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, precision, tf32=torch.get_float32_matmul_precision() != "highest")
        if peak is None and rank == 0:
            logger.warning(
                "no MFU: the peak FLOP/s of %s is not in raytrain_ddp.worker.flops.PEAKS; model_flops_per_s, "
                "the FLOP/s achieved, is reported: compare it with the GPU's datasheet",
                name,
            )
        return replace(self, peak=peak)


def count(compute_loss: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], tokens: int | None) -> ModelFlops:
    """The FLOPs of one training step (compute_loss, then backward) of `model` on `batch`, counted by
    torch's FLOP counter; never raises: a step it cannot count gives FLOPs that say why they are
    missing. The model is left in training mode with no gradients.

    The counter reads shapes alone, so the step runs on a copy of the model on the meta device, which
    computes nothing (GPT-2 small on two rows of 1,024 tokens: 0.8 s against 19 s on 2 CPU cores);
    on the model itself only where that copy cannot run it (a step that reads a value, say)."""
    model.train()
    if (empty := _meta_copy(model)) is not None:
        on_meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if (counted := _count(compute_loss, empty, on_meta, tokens)).known:
            return counted
    return _count(compute_loss, model, batch, tokens)


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of `model` whose parameters and buffers are empty tensors on the meta device (its values
    are never copied); None for a model already there, or one that cannot be copied."""
    if any(p.is_meta for p in model.parameters()):
        return None
    memo: dict[int, Any] = {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - it is then counted as it is
        return None


def _count(compute_loss: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], tokens: int | None) -> ModelFlops:
    from torch.utils.flop_counter import FlopCounterMode

    rows = len(next(iter(batch.values())))
    hook = f"the recipe can give them: {HOOK}, the FLOPs of a training step on `batch`"
    try:
        # skip_unsupported: an op the counter has no formula for still runs (and is named below); torch
        # 2.11 and older have no such argument, and a higher-order op without a formula fails the count
        skip = {"skip_unsupported": True} if "skip_unsupported" in inspect.signature(FlopCounterMode).parameters else {}
        counting = FlopCounterMode(display=False, custom_mapping=_model_flops_mapping(), **skip)
        with torch.enable_grad(), counting as counter:
            loss = compute_loss(model, batch)
            (loss[0] if isinstance(loss, tuple) else loss).backward()
    except Exception as e:  # noqa: BLE001 - the recipe has passed pre-flight: this only costs the count
        return ModelFlops(missing=f"torch's FLOP counter failed on a training step ({type(e).__name__}: {e}); {hook}")
    finally:
        model.zero_grad(set_to_none=True)
    if unsupported := getattr(counter, "get_unsupported_ops", dict)():
        ops = ", ".join(sorted(unsupported))
        return ModelFlops(missing=f"torch's FLOP counter cannot count {ops} in a training step; {hook}")
    flops = counter.get_total_flops()
    if flops <= 0:
        return ModelFlops(
            missing=f"torch's FLOP counter found no matrix product, convolution or attention it knows in a "
            f"training step; {hook}"
        )
    return ModelFlops.of_step(flops, rows, tokens, "counted by torch's FLOP counter on the example rows")


def _model_flops_mapping() -> dict[Any, Any]:
    aten = torch.ops.aten
    backward = (
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
    )
    return dict.fromkeys(backward, _attention_backward)


def _attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """The gradients of softmax(Q K^T) V's two products: twice their forward's 2·s_q·s_k·(d_qk + d_v)
    FLOPs per batch row and query head."""
    batch, heads, s_q, d_qk = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * 2 * batch * heads * s_q * s_k * (d_qk + d_v)


def utilization(trained: list[float], busy_s: list[float], peaks: list[float | None]) -> dict[str, Any]:
    """Each rank's model FLOPs trained and busy time (data wait + compute) -> the model FLOP/s of
    all of them (over the slowest rank's time, which sets the pace) and, where every rank's peak is
    known, MFU: that over the sum of the peaks, and each rank's own FLOP/s over its peak."""
    achieved = sum(trained) / max(max(busy_s), 1e-9)
    metrics: dict[str, Any] = {"model_flops_per_s": achieved}
    if peaks and all(peak is not None for peak in peaks):
        metrics["mfu"] = achieved / sum(peaks)
        metrics["mfu_per_worker"] = [f / max(b, 1e-9) / p for f, b, p in zip(trained, busy_s, peaks, strict=True)]
    return metrics


def si(value: float) -> str:
    """1.23e9 -> '1.23 G': a number with its SI prefix, for a unit to follow."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g} "
