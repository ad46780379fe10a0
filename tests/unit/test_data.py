"""How a worker cuts the rows it fetches from Ray Data into training batches."""

from __future__ import annotations

import torch

from raytrain_ddp.data.datasets import split_batches


def test_ray_data_fetches_are_cut_into_the_configured_batches_in_order():
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
