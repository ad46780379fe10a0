"""The benchmark's workloads, shared by both sides, on synthetic data held in memory (this machine
cannot download datasets; the cost of a step does not depend on the values):

    mlp       Ray Train's own DDP benchmark model, an MLP 784-512-512-10 on FashionMNIST-shaped rows,
              labelled by a fixed random linear teacher (so there is something to learn)
    resnet50  torchvision's ResNet-50 on 3x224x224 uint8 images, random labels, channels_last
              (bench/resnet50.yaml)
    gpt2      a GPT-2-small-sized decoder (12 layers, 768 wide, 12 heads, 1024 tokens, 50304 vocab)
              on random tokens                                                   (bench/gpt2.yaml)

As a raytrain_ddp recipe it is side B (`dataset.source: ray`, read through Ray Data) or B' (`torch`:
a map-style torch Dataset through prepare_data_loader); `torchrun_ddp.py` (side A) imports the same
functions. `model.trace` names a directory where every forward pass appends its start time to
`rank<R>-<pid>.txt`: the same probe on both sides, from which `harness.py` reads step times, time to
first step and teardown.

Both sides give rank r rows [r n, (r + 1) n), n = rows // world, in order: the share raytrain_ddp
gives a rank of a materialized Ray Dataset's blocks read in order (`train.shuffle: false`), and what
makes A and B train on the same batches, step for step.
"""

from __future__ import annotations

import os
import time
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def build_model(
    *, arch: Literal["mlp", "resnet50", "gpt2"] = "mlp", hidden: int = 512, classes: int = 10, trace: str | None = None
) -> nn.Module:
    """`hidden`: the MLP's width; `classes`: its and ResNet-50's outputs (GPT-2's vocabulary is fixed)."""
    if arch == "mlp":
        model = nn.Sequential(
            Pixels(),
            nn.Flatten(),
            nn.Linear(28 * 28, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )
    elif arch == "resnet50":
        import torchvision

        # channels_last (NHWC) on both sides: what cuDNN's convolutions run fastest in, bf16 above all
        model = nn.Sequential(Pixels(channels_last=True), torchvision.models.resnet50(num_classes=classes))
        model = model.to(memory_format=torch.channels_last)
    else:
        model = Decoder()
    if trace:
        model.register_forward_pre_hook(StepTrace(trace))
    return model


class Pixels(nn.Module):
    """uint8 images (what the throughput workloads keep in memory) to floats in [-1, 1], on the device;
    float inputs pass through. `channels_last`: the images laid out NHWC, as the model's weights."""

    def __init__(self, channels_last: bool = False):
        super().__init__()
        self.channels_last = channels_last

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = images.float() / 127.5 - 1 if images.dtype == torch.uint8 else images
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images


class Decoder(nn.Module):
    """GPT-2 small: pre-norm blocks, causal flash attention, tied input/output embeddings."""

    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, context: int = 1024, vocab: int = 50304):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.config = {"layers": layers, "width": width, "heads": heads, "context": context, "vocab": vocab}
        for table in (self.tokens, self.positions):  # GPT-2's initialization: small logits at the start
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits, or with `targets` the mean next-token loss: computed here, as nanoGPT does, so
        that torch.compile fuses the fp32 upcast of 16k x 50k logits into the loss and its backward
        (outside the graph, eager, the loss is a large share of a step's GPU time)."""
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tokens.weight.T
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def flops_per_token(self, sequence: int) -> float:
        """Training FLOPs per token: 6 per parameter (but the position table) plus attention's
        12 x layers x width x sequence (the PaLM paper's count, as nanoGPT's estimate_mfu)."""
        c = self.config
        parameters = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        return 6 * parameters + 12 * c["layers"] * c["width"] * sequence


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class StepTrace:
    """A forward pre-hook: `t <time>` per training forward, `e <time>` per evaluation forward, one
    unbuffered line each (a few microseconds), in training processes only (a process group is up),
    after a first line `threads <torch's intra-op threads>`."""

    def __init__(self, directory: str):
        self.directory, self.fd = directory, None
        # Under torch.compile: run as it is, not traced (a graph break before the forward). Wrapped
        # as the model is built in a training process (its process group is up, and DDP imports
        # torch._dynamo there anyway): torch.compiler.disable imports torch._dynamo, 1.3-2.4 s on 2
        # cores. Not at import: it then ran before a worker asked for its shards, and its first batch
        # waited for them (3 s, data wait 9.5 % instead of 3 %). Not in B's driver, whose pre-flight
        # builds the model with no process group: it paid that import, and no recipe of a user's does.
        self.write = torch.compiler.disable(self._write) if dist.is_initialized() else self._write

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.write(module)

    def _write(self, module: nn.Module) -> None:
        if not dist.is_initialized():
            return
        if self.fd is None:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"rank{dist.get_rank()}-{os.getpid()}.txt")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.write(self.fd, f"threads {torch.get_num_threads()}\n".encode())
        os.write(self.fd, f"{'t' if module.training else 'e'} {time.time():.6f}\n".encode())


def make_data(
    seed: int,
    rows: int,
    split: int = 0,
    *,
    shape: tuple[int, ...] = (1, 28, 28),
    classes: int = 10,
    sequence: int | None = None,
) -> dict[str, np.ndarray]:
    """Columns of `rows` rows (split 0: training, 1: validation):
    - `sequence` set: {"tokens": (rows, sequence + 1) int64}, random ids below `classes`;
    - 1-channel `shape`: {"image": float32 normal pixels, "label": a fixed random linear teacher's
      class of the image, the same teacher for both splits};
    - otherwise: {"image": uint8 pixels, "label": random}."""
    rng = np.random.default_rng([seed, split])
    if sequence is not None:
        return {"tokens": rng.integers(0, classes, (rows, sequence + 1), dtype=np.int64)}
    if shape[0] != 1:
        return {
            "image": rng.integers(0, 256, (rows, *shape), dtype=np.uint8),
            "label": rng.integers(0, classes, rows, dtype=np.int64),
        }
    images = rng.standard_normal((rows, *shape), dtype=np.float32)
    teacher = np.random.default_rng(seed).standard_normal((int(np.prod(shape)), classes), dtype=np.float32)
    return {"image": images, "label": (images.reshape(rows, -1) @ teacher).argmax(axis=1).astype(np.int64)}


def rank_rows(rows: int, rank: int, world: int) -> np.ndarray:
    """The row indices rank `rank` trains on, in order: its share, as raytrain_ddp's in-memory path
    (`raytrain_ddp.data.epoch.share`) gives it when nothing is shuffled."""
    n = rows // world
    return np.arange(rank * n, (rank + 1) * n)


class Rows(torch.utils.data.Dataset):
    """Columns in memory as a map-style torch Dataset of {column: tensor} rows."""

    def __init__(self, columns: dict[str, np.ndarray]):
        self.columns = {name: torch.from_numpy(values) for name, values in columns.items()}

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: values[i] for name, values in self.columns.items()}


def build_datasets(
    *,
    seed: int,
    rows: int = 61_440,
    val_rows: int = 10_240,
    block_rows: int = 1_024,
    source: Literal["ray", "torch"] = "ray",
    shape: tuple[int, ...] = (1, 28, 28),
    classes: int = 10,
    sequence: int | None = None,
) -> dict:
    """`source: ray`: Ray Datasets of `block_rows`-row blocks; `torch`: `Rows`. See make_data."""
    columns = {
        split: make_data(seed, n, i, shape=tuple(shape), classes=classes, sequence=sequence)
        for i, (split, n) in enumerate((("train", rows), ("val", val_rows)))
    }
    if source == "torch":
        return {split: Rows(c) for split, c in columns.items()}
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    def column(values: np.ndarray) -> pa.Array:
        return ArrowTensorArray.from_numpy(values) if values.ndim > 1 else pa.array(values)

    return {
        split: ray.data.from_blocks(
            [
                pa.table({name: column(values[i : i + block_rows]) for name, values in c.items()})
                for i in range(0, len(next(iter(c.values()))), block_rows)
            ]
        )
        for split, c in columns.items()
    }


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "tokens" in batch:  # the decoder's loss, inside its forward
        return model(batch["tokens"][:, :-1], batch["tokens"][:, 1:])
    logits, targets = _predict(model, batch)
    return F.cross_entropy(logits.float(), targets)


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    logits, targets = _predict(model, batch)
    return {
        "loss": (F.cross_entropy(logits.float(), targets, reduction="sum"), len(targets)),
        "accuracy": ((logits.argmax(dim=1) == targets).sum(), len(targets)),
    }


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["tokens"][:, :-1] if "tokens" in batch else batch["image"]


def _predict(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets), one row per prediction: next tokens for a decoder, labels for images."""
    if "tokens" in batch:
        return model(batch["tokens"][:, :-1]).flatten(0, 1), batch["tokens"][:, 1:].flatten()
    return model(batch["image"]), batch["label"]
