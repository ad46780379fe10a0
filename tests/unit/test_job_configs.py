"""Every job in jobs/ is found, and its YAML loads and shows how to run it. (Training each one is
tests/system/test_jobs.py's.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_ddp import load_config
from raytrain_ddp.cli import main
from raytrain_ddp.config import recipe as recipes

JOBS = (
    "breast_cancer",
    "char_gpt",
    "chat_sft",
    "digits",
    "fashion_mnist",
    "image_folder",
    "parquet_table",
    "regression",
    "two_tower",
)
REQUIRED = {"chat_sft": ["model.path=my-model", "dataset.path=chats.jsonl"]}  # keys with no default
SFT_CONFIGS = sorted((Path(__file__).parents[2] / "jobs" / "chat_sft").glob("*.yaml"))


def test_every_job_has_a_recipe_and_a_yaml_that_loads():
    assert sorted(recipes.available_jobs()) == sorted(JOBS)
    for job in JOBS:
        config = load_config(job, overrides=REQUIRED.get(job, []))
        assert config.job == job and config.scaling.num_workers == 2
        header = recipes.find_job(job).yaml.read_text().split("\n\n")[0]
        assert f"raytrain-ddp train {job}" in header and "ray job submit" in header, f"{job}.yaml header"


@pytest.mark.parametrize("config_file", SFT_CONFIGS, ids=[p.stem for p in SFT_CONFIGS])
def test_the_8_gpu_fine_tuning_configs_load_and_print(config_file, capsys):
    config = load_config("chat_sft", config_file=config_file, overrides=["dataset.path=s3://bucket/chats.jsonl"])
    assert (config.scaling.num_workers, config.scaling.use_gpu, config.train.precision) == (8, True, "bf16")
    assert config.model["gradient_checkpointing"] and (config.model["lora_r"] == 0) == ("full" in config_file.stem)

    code = main(["train", "chat_sft", "--config", str(config_file), "dataset.path=chats.jsonl", "--print-config"])
    assert code == 0 and "num_workers: 8" in capsys.readouterr().out
