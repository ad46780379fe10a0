"""A character-level GPT (minGPT-style decoder) on a text file, trained as a causal language model.

Characters are bytes (vocabulary 256), so any text file works with no tokenizer. The text at
`dataset.path` is cut into windows of `dataset.context + 1` bytes; the last `val_fraction` of the
file is held out. The windows are a map-style torch Dataset, so this job also shows that path of the
service (DistributedSampler, `prepare_data_loader`). Every epoch reports tokens/s; at the end the best
checkpoint's model writes a short sample, logged to MLflow as `sample.txt`.

    raytrain-ddp train char_gpt dataset.path=input.txt
    raytrain-ddp train char_gpt dataset.path=input.txt model.n_layer=6 model.n_embd=384 \
        scaling.use_gpu=true train.precision=bf16
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.utils.data import Dataset

VOCAB = 256  # bytes


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each on a residual branch."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(batch, time) byte ids -> (batch, time, 256) next-byte logits."""
        if idx.shape[1] > self.block_size:
            raise ValueError(
                f"a sequence of {idx.shape[1]} bytes is longer than model.block_size={self.block_size}; "
                "raise model.block_size or lower dataset.context"
            )
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        return self.head(self.ln_f(self.blocks(x)))

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int, temperature: float, seed: int) -> bytes:
        generator = torch.Generator().manual_seed(seed)
        idx = torch.tensor([list(prompt)], dtype=torch.long)
        for _ in range(length):
            logits = self(idx[:, -self.block_size :])[:, -1, :] / temperature
            next_byte = torch.multinomial(F.softmax(logits.float(), dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_byte], dim=1)
        return bytes(idx[0].tolist())


def build_model(
    *,
    block_size: Annotated[int, Field(ge=2)] = 64,
    n_layer: Annotated[int, Field(ge=1)] = 2,
    n_head: Annotated[int, Field(ge=1)] = 4,
    n_embd: Annotated[int, Field(ge=8)] = 128,
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1,
) -> nn.Module:
    if n_embd % n_head:
        raise ValueError(f"model.n_embd={n_embd} must be a multiple of model.n_head={n_head}")
    return GPT(block_size, n_layer, n_head, n_embd, dropout)


class Windows(Dataset):
    """Consecutive windows of `block + 1` bytes, every `stride` bytes: x is the first `block`, y the
    next byte of each position."""

    def __init__(self, data: torch.Tensor, block: int, stride: int):
        self.data, self.block, self.stride = data, block, stride

    def __len__(self) -> int:
        return max(0, (len(self.data) - self.block - 1) // self.stride + 1)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.data[i * self.stride : i * self.stride + self.block + 1].long()
        return {"x": chunk[:-1], "y": chunk[1:]}


def build_datasets(
    *,
    seed: int,
    path: str,
    context: Annotated[int, Field(ge=1)] = 64,
    stride: Annotated[int, Field(ge=1)] | None = None,
    val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1,
) -> dict[str, Dataset]:
    """Windows of `context` bytes (at most model.block_size) every `stride` bytes (default: `context`,
    no overlap); validation windows never overlap."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"dataset.path={path}: no such text file")
    data = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8)
    split = int(len(data) * (1 - val_fraction))
    windows = {
        "train": Windows(data[:split], context, stride or context),
        "val": Windows(data[split:], context, context),
    }
    for name, ds in windows.items():
        if len(ds) < 2:
            raise ValueError(f"dataset.path={path}: too short for two {name} windows of {context + 1} bytes")
    return windows


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """Per next-byte prediction: loss (nats) and accuracy."""
    logits = model(batch["x"]).flatten(0, 1)
    y = batch["y"].flatten()
    return {
        "loss": (F.cross_entropy(logits.float(), y, reduction="sum"), len(y)),
        "accuracy": ((logits.argmax(dim=1) == y).sum(), len(y)),
    }


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    return batch["x"].numel()


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["x"]


def artifacts(model: nn.Module) -> dict[str, str]:
    sample = model.generate(b"\n", length=300, temperature=0.8, seed=0)
    return {"sample.txt": sample.decode("utf-8", errors="replace")}
