"""Config: layering precedence, every kind of rejection (all at once, naming key and fix), round trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from raytrain_ddp.config.layering import load_config, with_overrides
from raytrain_ddp.config.schema import Config, ConfigError

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


def problems(*overrides: str, job: str = "digits", **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as error:
        load_config(job, overrides=overrides, **kwargs)
    return error.value.problems


def test_schema_defaults_then_job_yaml_then_config_file_then_overrides(tmp_path):
    layer = tmp_path / "layer.yaml"
    layer.write_text("train:\n  epochs: 3\n  batch_size: 16\nrun:\n  max_failures: 2\n")

    config = load_config("digits", config_file=layer, overrides=["train.batch_size=8"])

    assert config.train.eval_batch_size == 256  # schema default, set nowhere else
    assert config.train.lr == 2e-3 and config.checkpoint.score_attribute == "val_accuracy"  # job YAML
    assert config.train.epochs == 3 and config.run.max_failures == 2  # --config file over the job YAML
    assert config.train.batch_size == 8  # command line over everything
    assert config.model == {"num_classes": 10}  # the recipe's own default, resolved into the config
    assert config.scaling.resources_per_worker == {"CPU": 0.5}


def test_override_values_are_typed_yaml():
    config = load_config(
        "digits",
        overrides=["train.lr=3e-4", "scaling.use_gpu=false", "run.name=null", "scaling.resources_per_worker={CPU: 2}"],
    )
    assert config.train.lr == 3e-4 and isinstance(config.train.lr, float)
    assert config.run.name is None
    assert config.scaling.resources_per_worker == {"CPU": 2.0}


def test_a_job_can_be_named_by_the_path_of_its_yaml(tmp_path):
    from raytrain_ddp.config.recipe import find_job

    files = find_job("digits")
    assert load_config(str(files.yaml)).train.epochs == load_config("digits").train.epochs


def test_unknown_keys_name_the_path_the_allowed_keys_and_a_suggestion():
    found = problems("train.optimiser=sgd", "model.num_clases=3", "trian.epochs=2")
    assert any(p.startswith("train.optimiser: unknown key") and "did you mean 'optimizer'" in p for p in found)
    assert any(p.startswith("model.num_clases: unknown key") and "allowed keys here: num_classes" in p for p in found)
    assert any(p.startswith("trian: unknown key") and "'train'" in p for p in found)


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        ("train.epochs=-1", "train.epochs", "greater than or equal to 1"),
        ("train.batch_size=0", "train.batch_size", "greater than or equal to 1"),
        ("train.lr=0", "train.lr", "greater than 0"),
        ("train.lr=fast", "train.lr", "valid number"),
        ("train.epochs=2.5", "train.epochs", "valid integer"),
        ("train.optimizer=adam", "train.optimizer", "'adamw' or 'sgd'"),
        ("checkpoint.score_order=up", "checkpoint.score_order", "'max' or 'min'"),
        ("scaling.num_workers=0", "scaling.num_workers", "must be >= 1"),
        ("scaling.num_workers=[2, 1]", "scaling.num_workers", "a range [min, max] with 1 <= min <= max"),
        ("scaling.num_workers=[1, 2, 3]", "scaling.num_workers", "or an elastic range [min, max] (e.g. [1, 2])"),
        ("dataset.val_fraction=1.5", "dataset.val_fraction", "less than 1"),
        ("model.num_classes=ten", "model.num_classes", "valid integer"),
    ],
)
def test_impossible_values_are_rejected_with_the_key_and_what_is_allowed(override, key, says):
    [problem] = problems(override)
    assert problem.startswith(f"{key}: ") and says in problem
    assert "from command line" in problem


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        (
            "scaling.resources_per_worker.GPU=1",
            "scaling",
            "resources_per_worker asks for GPUs but use_gpu is false; set scaling.use_gpu=true",
        ),
        (
            "scaling.resources_per_worker.CPU=-1",
            "scaling",
            "resources_per_worker amounts must be >= 0, got {'CPU': -1.0}",
        ),
        ("run.name=a/b", "run", "name must be letters, digits, '.', '_' or '-' (a directory name), got 'a/b'"),
    ],
)
def test_checks_across_a_section_say_what_to_change(override, key, says):
    assert problems(override) == [f"{key}: {says}"]


def test_a_mapping_override_merges_into_the_yaml_mapping():
    config = load_config("digits", overrides=["scaling.use_gpu=true", "scaling.resources_per_worker={GPU: 1}"])
    assert config.scaling.resources_per_worker == {"CPU": 0.5, "GPU": 1.0}


def test_a_merge_leaves_the_job_yaml_as_it_was_for_the_resume_command():
    """A mapping override merges into a copy: the job's own layer (what `job_config` reads back, and
    the resume command is reckoned against) still says what its YAML says."""
    from raytrain_ddp.config.layering import job_config
    from raytrain_ddp.driver.plan import resume_command

    overrides = ["run.name=r", "scaling.use_gpu=true", "scaling.resources_per_worker={CPU: 2, GPU: 1}"]
    config = load_config("digits", overrides=overrides)
    assert job_config(config).scaling.resources_per_worker == {"CPU": 0.5}
    assert load_config("digits").scaling.resources_per_worker == {"CPU": 0.5}
    assert "scaling.resources_per_worker.CPU=2.0 scaling.resources_per_worker.GPU=1.0" in resume_command(config)


def test_an_elastic_range_keeps_the_global_batch_on_each_count_of_workers():
    """An optimizer step is max workers × grad_accum_steps micro-batches; on fewer workers each
    accumulates more. A count in the range that cannot share a step evenly is refused, naming the
    accumulation that would let it."""
    config = load_config("digits", overrides=["scaling.num_workers=[2, 4]", "train.grad_accum_steps=3"])
    assert (config.scaling.min_workers, config.scaling.max_workers, config.micro_batches_per_step) == (2, 4, 12)
    assert [config.accumulation_on(w) for w in (2, 3, 4)] == [6, 4, 3]
    assert load_config("digits", overrides=["scaling.num_workers=[3, 3]"]).scaling.num_workers == 3  # not elastic
    assert problems("scaling.num_workers=[2, 4]") == [
        "scaling.num_workers=[2, 4]: an optimizer step is 4 micro-batches (4 workers × train.grad_accum_steps 1), "
        "which 3 worker(s) cannot share evenly; set train.grad_accum_steps to a multiple of 3 (on 4 workers; more "
        "on fewer), or choose a range whose counts all divide 4"
    ]


def test_zero_workers_with_a_gpu_is_rejected():
    found = problems("scaling.num_workers=0", "scaling.use_gpu=true")
    assert any(p.startswith("scaling.num_workers:") for p in found)


def test_every_problem_is_reported_at_once_with_where_it_came_from(tmp_path):
    layer = tmp_path / "bad.yaml"
    layer.write_text("train:\n  epochs: -3\n")
    found = problems("train.batch_size=0", "ddp.bucket_cap_mb=-1", "bogus=1", "model.depth=3", config_file=layer)
    assert len(found) == 5
    assert any(p.startswith("train.epochs:") and str(layer) in p for p in found)
    message = str(pytest.raises(ConfigError, load_config, "digits", overrides=["train.batch_size=0", "bogus=1"]).value)
    assert "2 problem(s)" in message and "train.batch_size" in message and "bogus" in message


def test_malformed_overrides_files_and_jobs_are_named(tmp_path):
    assert problems("train.epochs")[0].startswith("override 'train.epochs': expected key.sub=value")
    assert "no such config file" in problems(config_file=tmp_path / "missing.yaml")[0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [unclosed\n")
    assert "not valid YAML" in problems(config_file=broken)[0]
    listed = tmp_path / "list.yaml"
    listed.write_text("- train.epochs: 2\n")
    assert "must be a mapping of keys to values, got list" in problems(config_file=listed)[0]
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        with_overrides(load_config("digits"), "train.epochs")
    unknown = problems(job="no_such_job")[0]
    assert "unknown job 'no_such_job'" in unknown and "digits" in unknown


def test_round_trip_and_frozen():
    config = load_config("digits", overrides=["train.epochs=2", "run.name=abc"])
    assert Config.from_dict(config.to_dict()) == config
    flat = config.flat()
    assert flat["train.epochs"] == 2 and flat["run.name"] == "abc" and flat["model.num_classes"] == 10
    with pytest.raises(ValidationError, match="frozen"):
        config.train.epochs = 5
    assert with_overrides(config, "train.epochs=7").train.epochs == 7
    assert config.train.epochs == 2


def test_sync_batchnorm_and_fp16_on_cpu_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"ddp.sync_batchnorm=true needs GPUs .* set scaling.use_gpu=true"):
        load_config(TINY, overrides=["ddp.sync_batchnorm=true"])
    with pytest.raises(ConfigError, match=r"train.precision=fp16 needs a GPU .* use bf16 or fp32"):
        load_config(TINY, overrides=["train.precision=fp16"])
    assert load_config(TINY, overrides=["ddp.sync_batchnorm=true", "scaling.num_workers=1"]).ddp.sync_batchnorm


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["scaling.strategy=fsdp", "ddp.static_graph=true", "ddp.bucket_cap_mb=50"],
            "ddp.static_graph, ddp.bucket_cap_mb set, but scaling.strategy=fsdp does not use ddp.* settings: "
            "remove them, or set scaling.strategy=ddp",
        ),
        (
            ["fsdp.reshard_after_forward=false"],
            "fsdp.reshard_after_forward set, but scaling.strategy=ddp does not use fsdp.* settings: "
            "remove them, or set scaling.strategy=fsdp",
        ),
        (["scaling.strategy=fsdp", "scaling.use_gpu=true", "train.precision=fp16"], "use train.precision=bf16"),
        (["scaling.strategy=fsdp", "checkpoint.upload=async"], "use checkpoint.upload=sync"),
        (["scaling.strategy=fsdp", "fsdp.cpu_offload=true"], "fsdp.cpu_offload=true needs GPUs"),
    ],
    ids=["ddp-settings-under-fsdp", "fsdp-settings-under-ddp", "fp16", "async-upload", "offload-on-cpu"],
)
def test_settings_the_strategy_does_not_take_are_refused_with_the_fix(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(TINY, overrides=overrides)
    assert load_config(TINY, overrides=["scaling.strategy=fsdp", "fsdp.reduce_dtype=bf16"]).fsdp.reduce_dtype == "bf16"


def test_compile_under_ddp_with_buckets_smaller_than_torchs_first_is_refused():
    [problem] = problems("train.compile=true", "ddp.bucket_cap_mb=0.5", job=TINY)
    assert problem.startswith("train.compile=true needs ddp.bucket_cap_mb >= 1 (got 0.5)")
    assert load_config(TINY, overrides=["train.compile=true", "ddp.bucket_cap_mb=1"]).train.compile
    assert load_config(TINY, overrides=["train.compile=true", "ddp.bucket_cap_mb=0.5", "scaling.num_workers=1"])


def test_cli_help_lists_every_key_with_its_default(capsys):
    from raytrain_ddp.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for line in (
        "train.epochs (10):",
        "train.optimizer (adamw|sgd):",
        "ddp.find_unused_parameters (false):",
        "run.storage_path (./runs):",
        "key.sub=value",
    ):
        assert line in out


def test_credentials_in_a_uri_are_refused_without_repeating_them():
    found = problems(
        "mlflow.tracking_uri=http://alice:hunter2@mlflow.internal:5000", "run.storage_path=s3://AKIA:s3cr3t@bucket/runs"
    )

    assert found == [
        "run: storage_path must not contain credentials (user:password@); set AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY or an instance role in the environment",
        "mlflow: tracking_uri must not contain credentials (user:password@); set MLFLOW_TRACKING_USERNAME / "
        "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN in the environment",
    ]
    assert load_config("digits", overrides=["mlflow.tracking_uri=http://mlflow.internal:5000"]).mlflow.tracking_uri
