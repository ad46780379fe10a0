"""A config is checked against the recipe's signatures read from its source (no torch to import), and
the result is always the imported recipe's: where the source is not simple enough, the recipe is imported."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ddp import ConfigError, load_config
from raytrain_ddp.config import recipe as recipes
from raytrain_ddp.config import signatures

ROOT = Path(__file__).parents[2]
RECIPES = sorted(ROOT.glob("jobs/*.py")) + [
    ROOT / "tests" / "jobs" / "tiny.py",
    ROOT / "tests" / "jobs" / "chat_faults.py",
]
# Read from the source; the others need the import (chat_sft: a validator function in `Location`;
# chat_faults: build_model's signature is set after its def, build_datasets is chat_sft's).
STATIC = {
    "breast_cancer",
    "char_gpt",
    "digits",
    "fashion_mnist",
    "image_folder",
    "parquet_table",
    "regression",
    "two_tower",
    "tiny",
}


SCHEMA = {"build_model": "model_kwargs", "build_datasets": "dataset_kwargs"}


def _fields(schema) -> dict[str, str]:
    return {name: repr(field) for name, field in schema.model_fields.items()}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_the_schema_read_from_the_source_is_the_imported_recipes(path):
    files = recipes.JobFiles(path.stem, path, None)
    read = signatures.read(path)
    assert (read is not None) == (path.stem in STATIC)

    imported, found = recipes.load(files), recipes.open_job(str(path))
    for name in signatures.FUNCTIONS:
        from_import = recipes.kwargs_schema(name, inspect.signature(getattr(imported, name), eval_str=True))
        assert _fields(getattr(found, SCHEMA[name])) == _fields(from_import)
        if read is not None:
            parameters = inspect.signature(getattr(imported, name), eval_str=True).parameters.values()
            assert [str(p) for p in read[name].parameters.values()] == [str(p) for p in parameters]


def test_loading_a_config_and_starting_ray_import_no_torch_pyarrow_or_ray_data():
    """What makes `--print-config` take a fifth of a second instead of five, and lets a new run's Ray
    start (`session.start`, imported by the command once its config is read) before the driver's
    heavy imports."""
    code = (
        "import sys; import raytrain_ddp.cli, raytrain_ddp.cluster.session; from raytrain_ddp import load_config; "
        "load_config('digits'); print(sorted({'torch', 'pyarrow', 'ray.data'} & sys.modules.keys()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _recipe(directory: Path, source: str) -> str:
    path = directory / "odd.py"
    path.write_text(source)
    return str(path)


COMMON = """\
from typing import Annotated

from pydantic import Field

def compute_loss(model, batch): ...
def evaluate(model, batch): ...
def model_input(batch): ...
def build_datasets(*, seed: int): ...
"""


@pytest.mark.parametrize(
    "source",
    [
        # A constant computed at import: only the import knows LIMIT.
        COMMON + "LIMIT = len('abc')\ndef build_model(*, n: Annotated[int, Field(le=LIMIT)] = 1): ...\n",
        # A signature changed after the def.
        COMMON
        + "import inspect\ndef build_model(*, m: int = 1, **kw): ...\n"
        + "build_model.__signature__ = inspect.Signature([inspect.Parameter('n', inspect.Parameter.KEYWORD_ONLY,"
        + " default=1, annotation=Annotated[int, Field(le=3)])])\n",
        # A constant bound twice: the second wins.
        COMMON + "LIMIT = 2\nLIMIT = 3\ndef build_model(*, n: Annotated[int, Field(le=LIMIT)] = 1): ...\n",
    ],
    ids=["computed-constant", "signature-set-later", "bound-twice"],
)
def test_a_signature_that_needs_the_import_is_read_by_importing(tmp_path, source):
    path = _recipe(tmp_path, source)
    assert signatures.read(Path(path)) is None

    assert load_config(path, overrides=["model.n=3"]).model == {"n": 3}
    with pytest.raises(ConfigError, match=r"model\.n: Input should be less than or equal to 3 \(got 4, from command"):
        load_config(path, overrides=["model.n=4"])


def test_a_recipe_read_from_its_source_is_imported_when_a_run_needs_it(tmp_path):
    path = _recipe(
        tmp_path, COMMON.replace("def model_input(batch): ...\n", "") + "def build_model(*, n: int = 1): ...\n"
    )
    config = load_config(path)  # the signatures are all a config needs

    from raytrain_ddp.config.layering import origin_of

    with pytest.raises(ConfigError, match=r"must define model_input \(or log_model\)"):
        _ = origin_of(config).recipe
