"""Settings the data decides (a recipe's `derive_settings`, read before Ray starts): the shipped
streaming jobs take their classes, channels and features from files the tests write; a value the user
set that disagrees is refused naming both; a validation folder is read with the training folder's
classes; and pre-flight names the settings on each side where the data and the model disagree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from raytrain_ddp import ConfigError, load_config
from raytrain_ddp.config import layering
from raytrain_ddp.config import recipe as recipes
from raytrain_ddp.data.stream import BadFile, ImageFolder
from raytrain_ddp.driver import plan
from raytrain_ddp.preflight.recipe_check import RecipeFailed, check_recipe

CLASSES = ("cat", "dog", "fish")


@pytest.fixture
def pets(tmp_path) -> Path:
    """3 classes of 32x32 RGB PNG files a split; the validation split has no fish."""
    rng = np.random.default_rng(0)
    for split, classes in (("train", CLASSES), ("val", CLASSES[:2])):
        for name in classes:
            (tmp_path / "pets" / split / name).mkdir(parents=True)
            for i in range(3):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "pets" / split / name / f"{i}.png")
    return tmp_path / "pets"


def _image_folder(pets: Path, *overrides: str):
    return load_config("image_folder", overrides=[f"dataset.path={pets}", "dataset.prepare=none", *overrides])


def test_an_image_folder_gives_its_classes_and_channels_and_the_jobs_yaml_gives_way(pets):
    config, derived = plan.from_the_data(_image_folder(pets, "dataset.grayscale=false"))

    assert derived == {"model.num_classes": 3, "model.channels": 3, "data.class_names": list(CLASSES)}
    assert config.model == {"num_classes": 3, "channels": 3, "small_images": True}
    assert config.data.class_names == list(CLASSES)
    # Nothing the data gives is an override the resume command must carry: the data gives it again.
    command = plan.resume_command(plan.resolve(config, "image_folder"))
    assert "model." not in command and "class_names" not in command, command
    # Later overrides keep what the data gave.
    assert layering.with_overrides(config, "train.epochs=1").model["num_classes"] == 3
    grayscale, _ = plan.from_the_data(_image_folder(pets))
    assert grayscale.model["channels"] == 1


def test_a_setting_that_disagrees_with_the_data_is_refused_naming_both_and_one_that_agrees_is_kept(
    pets, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:  # where a run stands, before Ray starts: nothing written
        plan.stand(_image_folder(pets, "dataset.grayscale=false", "model.num_classes=10", "model.channels=3"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pets"]
    [problem] = refused.value.problems
    assert problem.startswith("model.num_classes=10 (from command line) disagrees with the data (dataset.path=")
    assert "dataset.grayscale=false), which gives model.num_classes=3: leave model.num_classes out" in problem

    (tmp_path / "run.yaml").write_text("model:\n  channels: 1\n")
    config = load_config(
        "image_folder",
        config_file=tmp_path / "run.yaml",
        overrides=[f"dataset.path={pets}", "dataset.prepare=none", "dataset.grayscale=false"],
    )
    with pytest.raises(ConfigError, match=r"model.channels=1 \(from .*run.yaml\) disagrees with the data"):
        plan.from_the_data(config)

    agreed, _ = plan.from_the_data(_image_folder(pets, "model.num_classes=3", "data.class_names=[cat,dog,fish]"))
    assert agreed.model["num_classes"] == 3


def test_a_validation_folder_keeps_the_training_folders_labels_and_one_with_another_class_is_refused(pets):
    val = ImageFolder(str(pets / "val"), classes=CLASSES).listed(0).manifest
    assert val.classes == CLASSES and sorted(set(val.labels.tolist())) == [0, 1]
    assert ImageFolder(str(pets / "val")).class_names() == CLASSES[:2]

    (pets / "val" / "bird").mkdir()
    Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(pets / "val" / "bird" / "0.png")
    with pytest.raises(BadFile, match="class folder.s. bird not among the 3 classes it is read with"):
        ImageFolder(str(pets / "val"), classes=CLASSES).listed(0)


def test_parquet_shards_give_the_features_length_and_the_classes_from_their_footers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split in ("train", "val"):
        (tmp_path / "table" / split).mkdir(parents=True)
        for k, labels in enumerate(([0, 1, 2], [3, 1, 0])):
            features = pa.FixedSizeListArray.from_arrays(np.ones(15, dtype=np.float32), 5)
            table = pa.table({"features": features, "label": np.array(labels, dtype=np.int64)})
            pq.write_table(table, tmp_path / "table" / split / f"part-{k}.parquet")
    (tmp_path / "table" / "train" / "part-9.parquet").write_bytes(b"PAR1 cut short")  # listing names it

    config = load_config("parquet_table", overrides=[f"dataset.path={tmp_path / 'table'}", "dataset.prepare=none"])
    derived, settings = plan.from_the_data(config)

    assert settings == {"model.num_features": 5, "model.num_classes": 4}
    assert derived.model == {"num_features": 5, "num_classes": 4, "hidden": 128}


def test_a_recipe_may_derive_only_the_models_settings_and_the_class_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = Path(recipes.find_job("regression").recipe).read_text()
    (tmp_path / "job.py").write_text(recipe + '\n\ndef derive_settings(**dataset):\n    return {"train.lr": 1.0}\n')
    with pytest.raises(ConfigError, match=r"derive_settings may set model.\* and data.class_names, not train.lr"):
        plan.from_the_data(load_config(str(tmp_path / "job.py")))


def test_rows_the_model_cannot_take_name_the_settings_on_each_side(pets):
    config = _image_folder(pets, "dataset.grayscale=false", "dataset.size=[32,32]")  # underived: 1 channel
    recipe = recipes.load("image_folder")
    datasets = recipe.make_datasets(config)
    example = {k: torch.from_numpy(v) for k, v in datasets["val"].listed(0).example(2, 0).items()}

    with pytest.raises(RecipeFailed) as failed:
        check_recipe(config, recipe, example)

    message = str(failed.value)
    assert "compute_loss (" in message and "expected input[2, 3, 32, 32] to have 1 channels" in message
    assert "the data and the model disagree: two validation rows are image uint8 (2, 32, 32, 3)" in message
    assert "dataset.size=[32, 32], dataset.grayscale=false" in message and "model.channels=1," in message


def test_class_names_that_do_not_match_the_models_outputs_are_refused_in_pre_flight(pets):
    config = _image_folder(pets, "dataset.size=[8,8]", "data.class_names=[a,b,c]")  # 10 outputs, 3 names
    recipe = recipes.load("image_folder")
    example = {k: torch.from_numpy(v) for k, v in recipe.make_datasets(config)["val"].listed(0).example(2, 0).items()}

    with pytest.raises(RecipeFailed, match="gives 10 outputs a row, and data.class_names names 3"):
        check_recipe(config, recipe, example)


def test_print_config_shows_what_the_data_gives(pets, capsys):
    from raytrain_ddp.cli import main

    code = main(["train", "image_folder", f"dataset.path={pets}", "dataset.prepare=none", "--print-config"])

    printed = capsys.readouterr().out
    assert code == 0
    assert "model:\n  num_classes: 3\n  channels: 1\n" in printed and "  class_names:\n  - cat\n  - dog\n" in printed


def test_class_names_are_each_named_once_and_not_class(pets):
    with pytest.raises(ConfigError, match="each class once: 'dog' named twice"):
        _image_folder(pets, "data.class_names=[dog, cat, dog]")
    with pytest.raises(ConfigError, match="'class' names the column of each row's most likely class"):
        _image_folder(pets, "data.class_names=[class, cat]")
