"""Every job in jobs/ is found, and its YAML loads and shows how to run it. (Training each one is
tests/system/test_jobs.py's.)"""

from __future__ import annotations

from raytrain_ddp import load_config
from raytrain_ddp import recipe as recipes

JOBS = ("breast_cancer", "char_gpt", "digits", "fashion_mnist", "regression", "two_tower")


def test_every_job_has_a_recipe_and_a_yaml_that_loads():
    assert sorted(recipes.available_jobs()) == sorted(JOBS)
    for job in JOBS:
        config = load_config(job)
        assert config.job == job and config.scaling.num_workers == 2
        header = recipes.find_job(job).yaml.read_text().split("\n\n")[0]
        assert f"raytrain-ddp train {job}" in header and "ray job submit" in header, f"{job}.yaml header"
