"""What pre-flight refuses before any worker starts, on two rows and without Ray: every part of a
recipe's contract (each refusal names the function, the recipe's file and line, and is a recipe
error, not a configuration error), batch arithmetic an epoch cannot satisfy, train.compile where
torch cannot compile, and what a resumed run may not change."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import TensorDataset

from raytrain_ddp import ConfigError, load_config, with_overrides
from raytrain_ddp.config import recipe as recipes
from raytrain_ddp.data import stream
from raytrain_ddp.preflight.batches import check_batches, check_group_by_length, check_steps
from raytrain_ddp.preflight.checks import check_compile
from raytrain_ddp.preflight.recipe_check import RecipeCheck, RecipeFailed, check_recipe, check_score
from raytrain_ddp.preflight.resume import resume_conflicts

RECIPE = """
import torch
import torch.nn.functional as F
from torch import nn


def build_model(*, hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def build_datasets(*, seed: int) -> dict:
    raise NotImplementedError  # pre-flight is given its rows


def compute_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def evaluate(model, batch):
    logits, n = model(batch["x"]), len(batch["y"])
    return {"loss": (F.cross_entropy(logits, batch["y"], reduction="sum"), n)}


def model_input(batch):
    return batch["x"]
"""
EXAMPLE = {"x": torch.randn(2, 4), "y": torch.tensor([0, 2])}


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe's file is named relative to the working directory


def _check(tmp_path: Path, *edits: tuple[str, str], example=EXAMPLE, overrides=()) -> RecipeCheck:
    text = RECIPE
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    (tmp_path / "job.py").write_text(text)
    config = load_config(str(tmp_path / "job.py"), overrides=list(overrides))
    return check_recipe(config, recipes.load(str(tmp_path / "job.py")), example)


def _refusal(tmp_path: Path, *edits: tuple[str, str]) -> str:
    with pytest.raises(RecipeFailed) as refused:
        _check(tmp_path, *edits)
    message = str(refused.value)
    assert message.startswith("recipe error in job 'job'") and "invalid configuration" not in message
    assert isinstance(refused.value, ConfigError)  # refused like a config: before Ray Train, exit 2
    return message


def test_a_recipe_that_keeps_the_contract_reports_its_metrics(tmp_path):
    checked = _check(tmp_path)
    assert {"val_loss", "train_loss", "epoch"} <= checked.reported
    # A CPU run counts no FLOPs (it has no peak to hold them against): nothing to pay for, nothing reported.
    assert not checked.flops.known and not {"model_flops_per_s", "mfu", "mfu_per_worker"} & checked.reported


def test_a_gpu_run_counts_the_flops_of_a_training_step_and_reports_them(tmp_path):
    checked = _check(tmp_path, overrides=["scaling.use_gpu=true"])  # counted on the driver: no GPU needed
    assert checked.flops.per_sample == 6 * 8 * 3 + 4 * 4 * 8  # no input gradient for the first layer
    assert "model_flops_per_s" in checked.reported
    assert not {"mfu", "mfu_per_worker"} & checked.reported  # only on GPUs of known peak: nothing may rely on them


COUNT_FLOPS = ("def model_input(batch):", "def count_flops(model, batch):\n    return {}\n\n\ndef model_input(batch):")


def test_a_recipe_that_counts_its_own_flops_is_believed(tmp_path):
    checked = _check(tmp_path, (COUNT_FLOPS[0], COUNT_FLOPS[1].format("1000.0 * len(batch['x'])")))
    assert checked.flops.per_sample == 1000.0 and checked.flops.source == "the recipe's count_flops"


def test_a_flop_count_that_is_no_positive_number_is_refused(tmp_path):
    message = _refusal(tmp_path, (COUNT_FLOPS[0], COUNT_FLOPS[1].format("0")))
    line = RECIPE.splitlines().index("def model_input(batch):") + 1
    assert f"count_flops (job.py, line {line}) must return the FLOPs of a training step on the batch" in message


def test_evaluate_returning_a_mean_is_refused_naming_the_function_file_and_line(tmp_path):
    message = _refusal(tmp_path, ('reduction="sum"), n)}', 'reduction="mean"))}'))
    line = RECIPE.splitlines().index("def evaluate(model, batch):") + 1
    assert f"evaluate (job.py, line {line}) must return {{name: (sum, count)}}" in message
    assert "'loss' is tensor(" in message


def test_an_error_inside_compute_loss_shows_the_recipe_line_that_raised_it(tmp_path):
    message = _refusal(tmp_path, ('batch["y"])\n\n\ndef evaluate', 'batch["y"].float())\n\n\ndef evaluate'))
    line = RECIPE.splitlines().index('    return F.cross_entropy(model(batch["x"]), batch["y"])') + 1
    assert (
        f'compute_loss (job.py, line {line}: return F.cross_entropy(model(batch["x"]), batch["y"].float()))' in message
    )
    assert "raised RuntimeError" in message and "Long" in message


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (('return F.cross_entropy(model(batch["x"]), batch["y"])\n', "return model(batch['x'])\n"), "scalar tensor"),
        (('return F.cross_entropy(model(batch["x"]), batch["y"])\n', "return torch.tensor(1.0)\n"), "no gradient"),
        (
            (
                'return F.cross_entropy(model(batch["x"]), batch["y"])\n',
                "return torch.tensor(float('nan'), requires_grad=True)\n",
            ),
            "must be finite",
        ),
        (
            ('def model_input(batch):\n    return batch["x"]', 'def model_input(batch):\n    return batch["x"][:, :2]'),
            "model_input",
        ),
        (("return nn.Sequential(", "raise ValueError('no such layer'); return nn.Sequential("), "build_model"),
    ],
    ids=["not-a-scalar", "no-gradient", "not-finite", "wrong-model-input", "build-model-raises"],
)
def test_each_broken_part_of_the_contract_is_named(tmp_path, edit, says):
    assert says in _refusal(tmp_path, edit)


def test_under_fsdp_blocks_the_recipe_names_and_the_model_lacks_are_refused(tmp_path):
    names = ("def model_input(batch):", "def shard_blocks(model):\n    return [nn.GRU]\n\n\ndef model_input(batch):")
    with pytest.raises(
        RecipeFailed,
        match=r"shard_blocks \(job.py, line \d+\) names GRU, and the model \(Sequential\) holds none of them",
    ):
        _check(tmp_path, names, overrides=["scaling.strategy=fsdp"])
    assert _check(tmp_path, names)  # under DDP the hook is not asked


def test_fsdp_shards_a_hugging_face_models_decoder_layers_or_the_blocks_a_recipe_names():
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain_ddp.worker import sharding

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2
    )
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    plain = recipes.Recipe("r", *(lambda **_: None,) * 4)
    assert sharding.blocks(plain, llama) == list(llama.model.layers)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    assert sharding.blocks(plain, mlp) == []  # the root alone
    named = recipes.Recipe("r", *(lambda **_: None,) * 4, shard_blocks=lambda model: [model[0], torch.nn.ReLU])
    assert sharding.blocks(named, mlp) == [mlp[0], mlp[1]]


def test_a_resume_may_not_switch_the_strategy(tmp_path):
    (tmp_path / "job.py").write_text(RECIPE)
    config = load_config(str(tmp_path / "job.py"))
    saved = config.to_dict()
    del saved["scaling"]["strategy"], saved["fsdp"]  # a run started before the keys existed: DDP
    assert resume_conflicts(saved, config) == []
    [conflict] = resume_conflicts(saved, with_overrides(config, "scaling.strategy=fsdp"))
    assert conflict == "scaling.strategy: was 'ddp' when the run started, now 'fsdp'; a resumed run keeps it"
    fsdp = with_overrides(config, "scaling.strategy=fsdp")
    assert resume_conflicts(fsdp.to_dict(), with_overrides(fsdp, "fsdp.reshard_after_forward=false")) == []


def test_a_score_metric_the_recipe_does_not_report_is_a_config_problem(tmp_path):
    reported = _check(tmp_path).reported
    config = load_config(str(tmp_path / "job.py"), overrides=["checkpoint.score_attribute=val_accuracy"])
    [problem] = check_score(config, reported)
    assert "'val_accuracy' is not a reported metric; choose one of:" in problem and "val_loss" in problem


@pytest.mark.parametrize(
    ("overrides", "rows", "says"),
    [
        (
            ["train.batch_size=500", "train.drop_last=true"],
            142,
            "71 per worker, fewer than one batch of 500 with train.drop_last=true: an epoch would train nothing",
        ),
        (
            ["train.batch_size=500"],
            142,
            "each epoch would be one short step of 71 rows per worker; use train.batch_size <= 71",
        ),
        (
            ["train.batch_size=8", "train.grad_accum_steps=16"],
            142,
            "train.grad_accum_steps: 16 micro-batches per step, but each worker has 9 batch(es)",
        ),
        (["train.batch_size=8", "scaling.num_workers=4"], 3, "0 per worker"),
    ],
    ids=["no-step", "one-short-step", "accumulation-beyond-the-epoch", "fewer-rows-than-workers"],
)
def test_batch_arithmetic_an_epoch_cannot_satisfy_is_refused(tmp_path, overrides, rows, says):
    (tmp_path / "job.py").write_text(RECIPE)
    config = load_config(str(tmp_path / "job.py"), overrides=overrides)
    problems = check_batches(config, rows)
    assert len(problems) == 1 and says in problems[0], problems


def test_batch_arithmetic_that_fits_passes(tmp_path):
    (tmp_path / "job.py").write_text(RECIPE)
    config = load_config(str(tmp_path / "job.py"), overrides=["train.batch_size=71", "train.grad_accum_steps=1"])
    assert check_batches(config, 142) == []


def test_grouping_by_length_needs_a_whole_number_column_of_rows_each_rank_reads_itself(tmp_path):
    (tmp_path / "job.py").write_text(RECIPE)
    (tmp_path / "rows").mkdir()
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": [0, 2]}), tmp_path / "rows" / "part-0.parquet")
    rows = stream.Parquet(str(tmp_path / "rows"), columns=("x", "y")).listed(max_bad_files=0)
    streams = {"train": rows, "val": rows}

    def problems(column, datasets=streams, example=EXAMPLE):
        config = load_config(str(tmp_path / "job.py"), overrides=[f"train.group_by_length={column}"])
        return check_group_by_length(config, datasets, example)

    assert problems("y") == []
    assert problems("null") == []
    assert problems("length") == [
        "train.group_by_length: the rows have no column 'length' (they have x, y); name the column of each row's length"
    ]
    assert problems("x") == ["train.group_by_length: column 'x' is not one whole number a row (a length)"]
    torch_rows = {"train": TensorDataset(EXAMPLE["x"]), "val": TensorDataset(EXAMPLE["x"])}
    [refused] = problems("y", datasets=torch_rows)
    assert "grouped by length from streams and materialized Ray Datasets, not from this job's TensorDataset" in refused
    assert refused.endswith("or set train.group_by_length=null")


def test_compiling_where_torch_cannot_is_refused_with_the_fix(tmp_path, monkeypatch):
    from torch._inductor import config as inductor

    (tmp_path / "job.py").write_text(RECIPE)
    config = load_config(str(tmp_path / "job.py"), overrides=["train.compile=true"])
    assert check_compile(config) == []
    with inductor.patch("cpp.cxx", (None, str(tmp_path / "no-g++"))):  # as if $CXX named no compiler
        [problem] = check_compile(config)
        assert check_compile(with_overrides(config, "train.compile=false")) == []
    assert problem.startswith("train.compile: compiling for CPU needs a C++ compiler and none works on this machine")
    assert "install g++ (apt-get install g++), set CXX to one, or set train.compile=false" in problem
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)  # as on a Python too new for it
    [problem] = check_compile(config)
    assert problem.startswith(f"train.compile: torch {torch.__version__} cannot compile on Python 3.")


def test_a_resume_may_not_switch_compile_on_and_a_run_older_than_the_key_resumes(tmp_path):
    (tmp_path / "job.py").write_text(RECIPE)
    config = load_config(str(tmp_path / "job.py"))
    saved = config.to_dict()
    del saved["train"]["compile"]  # a run started before train.compile existed: it trained eagerly
    assert resume_conflicts(saved, config) == []
    [conflict] = resume_conflicts(saved, with_overrides(config, "train.compile=true"))
    assert conflict == "train.compile: was False when the run started, now True; a resumed run keeps it"


def test_a_resume_may_change_the_workers_keeping_the_global_batch(tmp_path):
    (tmp_path / "job.py").write_text(RECIPE)
    config = with_overrides(load_config(str(tmp_path / "job.py")), "scaling.num_workers=2")
    saved = config.to_dict()  # 2 workers × 1 micro-batch a step

    halved = with_overrides(config, "scaling.num_workers=1", "train.grad_accum_steps=2")
    assert resume_conflicts(saved, halved) == []
    [alone] = resume_conflicts(saved, with_overrides(config, "scaling.num_workers=1"))
    assert alone.endswith(
        "1 workers × train.grad_accum_steps 1 would change its global batch: "
        "with 1 workers set train.grad_accum_steps=2"
    )
    [three] = resume_conflicts(saved, with_overrides(config, "scaling.num_workers=3"))
    assert three.endswith("use a number of workers that divides 2")
    [accumulation] = resume_conflicts(saved, with_overrides(config, "train.grad_accum_steps=2"))
    assert accumulation.startswith("scaling.num_workers: the run steps on 2 micro-batches of train.batch_size")


def test_a_resize_that_would_change_the_steps_of_an_epoch_is_refused(tmp_path):
    """81 rows in batches of 10: 9 batches on 1 worker, 4 accumulated: 3 steps; 20 rows on each of 4
    workers: 2 batches, 2 steps. The same 40 rows a step, but the schedule would shift."""
    (tmp_path / "job.py").write_text(RECIPE)
    config = with_overrides(load_config(str(tmp_path / "job.py")), "train.batch_size=10")
    saved = with_overrides(config, "scaling.num_workers=1", "train.grad_accum_steps=4").to_dict()

    on_4 = with_overrides(config, "scaling.num_workers=4", "train.grad_accum_steps=1")
    assert check_steps(on_4, None, 81) == [] and check_steps(on_4, saved, 80) == []  # 2 steps on both
    [problem] = check_steps(on_4, saved, 81)
    assert problem.startswith(
        "scaling.num_workers: 81 training rows make 2 optimizer steps an epoch on 4 workers × train.grad_accum_steps "
        "1, the run made 3 on 1 × 4"
    )


def test_an_elastic_range_must_make_the_same_steps_an_epoch_on_each_count_of_workers(tmp_path):
    """81 rows in batches of 10, workers [1, 2]: 9 batches on 1 worker accumulating 2 make 5 steps, 4
    batches of 40 rows on each of 2 make 4; with drop_last, 8 and 4 batches: 4 steps on both."""
    (tmp_path / "job.py").write_text(RECIPE)
    config = with_overrides(load_config(str(tmp_path / "job.py")), "train.batch_size=10", "scaling.num_workers=[1, 2]")
    [problem] = check_steps(config, None, 81)
    assert problem == (
        "scaling.num_workers=[1, 2]: 81 training rows make a different number of optimizer steps an epoch on each "
        "count of workers (5 on 1 × 2, 4 on 2 × 1 micro-batches a step): the learning-rate schedule would depend "
        "on it; set train.drop_last=true or a train.batch_size that splits the rows the same way on each"
    )
    assert check_steps(with_overrides(config, "train.drop_last=true"), None, 81) == []
    # The batch arithmetic is checked on each count: on 2 workers, 40 rows are fewer than a batch of 50.
    [short] = check_batches(with_overrides(config, "train.batch_size=50"), 81)
    assert "40 per worker, fewer than one batch of 50" in short


def test_a_run_may_resume_elastic_keeping_its_global_batch(tmp_path):
    (tmp_path / "job.py").write_text(RECIPE)
    config = with_overrides(load_config(str(tmp_path / "job.py")), "scaling.num_workers=2")
    saved = config.to_dict()  # 2 workers × 1 micro-batch a step

    assert resume_conflicts(saved, with_overrides(config, "scaling.num_workers=[1, 2]")) == []
    [wider] = resume_conflicts(saved, with_overrides(config, "scaling.num_workers=[2, 4]", "train.grad_accum_steps=3"))
    assert wider == (
        "scaling.num_workers: the run steps on 2 micro-batches of train.batch_size (2 workers × "
        "train.grad_accum_steps 1); 2–4 workers × train.grad_accum_steps 3 would change its global batch: use a "
        "number of workers that divides 2"
    )
    elastic = with_overrides(config, "scaling.num_workers=[1, 2]").to_dict()
    assert resume_conflicts(elastic, with_overrides(config, "scaling.num_workers=1", "train.grad_accum_steps=2")) == []
