"""The job the README shows ("Writing your own job") is complete: written out as the README has it, its
config loads and its recipe trains and evaluates on raw rows of the wine table, standardizing them
inside the model. (Trained end to end and served over HTTP: tests/system/test_first_hour.py.)"""

from __future__ import annotations

import torch
from sklearn.datasets import load_wine

from raytrain_ddp import load_config
from raytrain_ddp.config import recipe


def test_the_readme_job_loads_trains_and_evaluates(readme_job):
    job = readme_job
    config = load_config(str(job), overrides=["dataset.path=wine.csv"])
    assert config.model == {"hidden": 32}
    assert config.dataset == {"path": "wine.csv", "label": "target", "val_fraction": 0.25}
    assert config.checkpoint.score_attribute == "val_accuracy"

    wine = recipe.load(str(job))
    x, y = load_wine(return_X_y=True)
    batch = {"x": torch.tensor(x[:32], dtype=torch.float32), "y": torch.tensor(y[:32])}
    torch.manual_seed(0)
    fitted = {"mean": x.mean(axis=0), "std": x.std(axis=0)}
    model = wine.build_model(fitted=fitted, **config.model)
    standardized = model[0](batch["x"])  # raw rows in: the model standardizes them itself
    assert torch.allclose(standardized, torch.tensor((x[:32] - x.mean(0)) / x.std(0), dtype=torch.float32), atol=1e-5)
    loss = wine.compute_loss(model, batch)
    loss.backward()
    assert loss.ndim == 0 and all(p.grad is not None for p in model.parameters())
    metrics = wine.evaluate(model.eval(), batch)
    assert set(metrics) == {"loss", "accuracy"} and all(count == 32 for _, count in metrics.values())
    assert torch.equal(wine.model_input(batch), batch["x"])
