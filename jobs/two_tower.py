"""A two-tower recommender: a user tower and an item tower trained with in-batch negatives, on an
interactions table (Parquet, columns `user_id`, `item_id`) read with Ray Data.

Each (user, item) interaction is a positive; the other items of the batch are its negatives (a
softmax over the batch's items). Held-out interactions measure recall@10: how often the held-out item
is among the 10 items the model scores highest for that user, out of all `model.num_items`. The job
reports the same for a popularity baseline (the 10 items most frequent in the training split), so the
figure can be judged.

    raytrain-ddp train two_tower dataset.path=interactions.parquet model.num_users=5000 model.num_items=2000
    raytrain-ddp train two_tower dataset.path=s3://bucket/interactions/ model.num_users=... model.num_items=...
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
import ray.data
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

TOP_K = 10


class TwoTower(nn.Module):
    def __init__(self, num_users: int, num_items: int, dim: int, temperature: float):
        super().__init__()
        self.num_users, self.num_items, self.temperature = num_users, num_items, temperature
        self.user_tower = nn.Sequential(
            nn.Embedding(num_users, dim), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim)
        )
        self.item_tower = nn.Sequential(
            nn.Embedding(num_items, dim), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim)
        )

    def forward(self, user_ids: torch.Tensor, item_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Scores: (users, items) of the batch's users against `item_ids` (training: the batch's own
        items) or, without them, against every item (recommending)."""
        users = F.normalize(self.user_tower(user_ids), dim=-1)
        if item_ids is None:
            item_ids = torch.arange(self.num_items, device=user_ids.device)
        items = F.normalize(self.item_tower(item_ids), dim=-1)
        return users @ items.T / self.temperature


def build_model(
    *,
    num_users: Annotated[int, Field(ge=1)] = 1000,
    num_items: Annotated[int, Field(ge=TOP_K)] = 500,
    dim: Annotated[int, Field(ge=1)] = 32,
    temperature: Annotated[float, Field(gt=0)] = 0.1,
) -> nn.Module:
    return TwoTower(num_users, num_items, dim, temperature)


def build_datasets(
    *, seed: int, path: str, val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1
) -> dict[str, ray.data.Dataset]:
    """Rows of {"user_id", "item_id"} (int64); a random `val_fraction` of the interactions is held
    out, and each held-out row also says whether its item is one of the popularity baseline's 10."""
    interactions = ray.data.read_parquet(path, columns=["user_id", "item_id"]).map_batches(_as_int64)
    train, val = interactions.train_test_split(test_size=val_fraction, shuffle=True, seed=seed)
    train = train.materialize()
    counts = train.groupby("item_id").count().to_pandas()
    popular = counts.sort_values(["count()", "item_id"], ascending=[False, True])["item_id"].to_numpy()[:TOP_K]
    val = val.map_batches(lambda b: {**b, "popular_hit": np.isin(b["item_id"], popular)})
    return {"train": train, "val": val.materialize()}


def _as_int64(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"user_id": batch["user_id"].astype(np.int64), "item_id": batch["item_id"].astype(np.int64)}


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """In-batch softmax: row i's positive is column i."""
    scores = model(batch["user_id"], batch["item_id"])
    return F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))


def evaluate(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    top = model(batch["user_id"]).topk(TOP_K, dim=1).indices
    hits = (top == batch["item_id"][:, None]).any(dim=1)
    n = len(hits)
    return {"recall_at_10": (hits.sum(), n), "popularity_recall_at_10": (batch["popular_hit"].sum(), n)}


def model_input(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["user_id"]
