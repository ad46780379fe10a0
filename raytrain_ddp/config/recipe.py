"""Recipes: finding a job's files, importing its module, and checking it keeps the contract.

A job is a pair in `jobs/`: `<name>.py` (the recipe) and `<name>.yaml` (its config). The recipe is
plain functions with keyword-only arguments:

    build_model(**model) -> torch.nn.Module
    build_datasets(*, seed, **dataset) -> {"train": ..., "val": ...}   # two ray.data.Dataset (streamed
                                                           # by Ray Data) or two map-style torch Datasets,
                                                           # rows as users have them (raw features, pixels)
    compute_loss(model, batch) -> scalar tensor            # the training objective, mean over the batch
    evaluate(model, batch) -> {name: (sum, count)}         # validation sums; the service all-reduces them
    model_input(batch) -> tensor                           # what the model's forward takes (for MLflow)

and, optionally:

    derive_settings(**dataset) -> {"model.key": value}     # settings the data decides (classes, channels,
                                                           # features, data.class_names), read before Ray
                                                           # starts: a value the user set that differs is
                                                           # refused, naming both; the job's YAML gives way
    count_tokens(batch) -> int                             # tokens in a batch: reports tokens/s
    artifacts(model) -> {file name: text}                  # logged to MLflow with the registered model
    derived_metrics({name: global value}) -> {name: value} # from evaluate's means, e.g. perplexity = exp(loss)
    generate_samples(model, batch) -> [{column: text}]     # rank 0, at each evaluation, on two validation
                                                           # rows: logged to MLflow as the table generated.json
    build_empty_model(**model) -> torch.nn.Module          # the architecture without weights (meta device):
                                                           # the driver checks the recipe with it and never
                                                           # builds the real model; registration runs as a
                                                           # Ray task with a worker's resources
    log_model(model, *, name) -> mlflow ModelInfo          # how the model is logged (e.g. mlflow.transformers),
                                                           # inside the service's MLflow run; then model_input
                                                           # is not needed
    count_flops(model, batch) -> number                    # FLOPs of one training step (forward + backward) on
                                                           # the batch, for a model torch's FLOP counter cannot
                                                           # count (raytrain_ddp/worker/flops.py): reports MFU
    shard_blocks(model) -> [module class or module]        # scaling.strategy=fsdp: the repeated blocks FSDP2
                                                           # shards one by one (then the root); default: a
                                                           # Hugging Face model's own (its _no_split_modules,
                                                           # the decoder layers), else the root alone

`compute_loss` may also return `(sum, count)`: a loss summed over `count` items (tokens, say) of the
batch. The service then divides each optimizer step's gradient by the count of the whole global batch
(every micro-batch on every rank), so the step is the mean over items however they fall into rows,
micro-batches and workers.

Besides its YAML keys, `build_model` gets `precision` (train.precision) and `build_datasets` gets
`model` (the model's settings: where its tokenizer is, say) if they name those parameters.

Inference travels with the model: the datasets hold raw rows and the model takes them, so the
registered model takes the rows its users have. What turns raw rows into what the network needs is
part of the model (`raytrain_ddp.layers.Standardize`, a reshape). Where that needs statistics of
the training rows (a mean and a standard deviation, a vocabulary), `build_datasets` returns them as
a third entry, `"fitted"`, and `build_model` gets them as `fitted`: the model holds them in buffers,
so they are saved with every checkpoint and applied inside the logged model.

The YAML's `model:` and `dataset:` mappings are those keyword arguments, validated against the
signatures (types, and pydantic constraints such as `Annotated[float, Field(gt=0, lt=1)]`) before Ray
starts, so each default and each limit lives once, in the recipe. `open_job` reads the two signatures
from the recipe's source where they are simple (`signatures.py`), so checking or printing a config
imports no torch; the recipe itself is imported when a command first needs its functions.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, create_model

from raytrain_ddp.config import signatures

if TYPE_CHECKING:
    import torch

    from raytrain_ddp.config.schema import Config

REQUIRED = ("build_model", "build_datasets", "compute_loss", "evaluate")
OPTIONAL = (
    "derive_settings",
    "model_input",
    "count_tokens",
    "artifacts",
    "derived_metrics",
    "generate_samples",
    "build_empty_model",
    "log_model",
    "count_flops",
    "shard_blocks",
)
# Keywords the service passes beside the YAML's, to the functions that name them.
SERVICE_KWARGS = {"build_model": ("precision", "fitted"), "build_datasets": ("seed", "model")}
JOBS_DIR = "jobs"


class RecipeError(ValueError):
    """A job cannot be found or its recipe breaks the contract."""


@dataclass(frozen=True)
class JobFiles:
    name: str
    recipe: Path
    yaml: Path | None


@dataclass(frozen=True)
class Recipe:
    """A recipe's functions, picklable by value so workers need no copy of `jobs/`."""

    name: str
    build_model: Callable[..., Any]
    build_datasets: Callable[..., Any]
    compute_loss: Callable[..., Any]
    evaluate: Callable[..., Any]
    derive_settings: Callable[..., dict[str, Any]] | None = None
    model_input: Callable[..., Any] | None = None
    count_tokens: Callable[..., int] | None = None
    artifacts: Callable[..., dict[str, str]] | None = None
    derived_metrics: Callable[..., dict[str, float]] | None = None
    generate_samples: Callable[..., list[dict[str, str]]] | None = None
    build_empty_model: Callable[..., Any] | None = None
    log_model: Callable[..., Any] | None = None
    count_flops: Callable[..., float] | None = None
    shard_blocks: Callable[..., list[Any]] | None = None

    @property
    def holds_large_model(self) -> bool:
        """Whether the driver must not build the model (the recipe gives its architecture instead)."""
        return self.build_empty_model is not None

    def make_model(self, config: Config, fitted: Any = None, *, empty: bool = False) -> torch.nn.Module:
        """build_model (or, `empty`, build_empty_model) with the config's model settings and what
        build_datasets fitted on the training rows."""
        kwargs = _with_service_kwargs(
            self.build_model, dict(config.model), precision=config.train.precision, fitted=fitted
        )
        return (self.build_empty_model if empty else self.build_model)(**kwargs)

    def derived_from(self, config: Config) -> dict[str, Any]:
        """The dataset settings derive_settings takes: those it names (all, if it takes **dataset), and
        `seed` and `model` as build_datasets gets them."""
        params = inspect.signature(self.derive_settings).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        dataset = {k: v for k, v in config.dataset.items() if takes_all or k in params}
        return _with_service_kwargs(self.derive_settings, dataset, seed=config.seed, model=dict(config.model))

    def make_datasets(self, config: Config) -> Any:
        kwargs = _with_service_kwargs(self.build_datasets, dict(config.dataset), model=dict(config.model))
        return self.build_datasets(seed=config.seed, **kwargs)


@dataclass
class Job:
    """A job found: its files, the schemas of its `model:` and `dataset:` settings, and its recipe,
    imported on first use of `recipe` (which raises RecipeError for a recipe that breaks the contract)."""

    files: JobFiles
    model_kwargs: type[BaseModel]
    dataset_kwargs: type[BaseModel]
    _recipe: Recipe | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.files.name

    @property
    def recipe(self) -> Recipe:
        if self._recipe is None:
            self._recipe = load(self.files)
        return self._recipe


def open_job(job: str) -> Job:
    """Find `job` and read the schemas of its settings: from the recipe's source where the two
    signatures are simple, else by importing the recipe (and checking its contract)."""
    files = find_job(job)
    read = signatures.read(files.recipe)
    if read is not None:
        return Job(files, *(kwargs_schema(name, read[name]) for name in signatures.FUNCTIONS))
    recipe = load(files)
    imported = [inspect.signature(getattr(recipe, name), eval_str=True) for name in signatures.FUNCTIONS]
    return Job(files, *(kwargs_schema(n, s) for n, s in zip(signatures.FUNCTIONS, imported, strict=True)), recipe)


def job_search_path() -> list[Path]:
    """Where job names are looked up: ./jobs, then the jobs/ beside this package (a source checkout)."""
    here = Path(__file__).resolve().parents[2] / JOBS_DIR
    return list(dict.fromkeys([Path.cwd() / JOBS_DIR, here]))


def available_jobs() -> list[str]:
    return sorted({p.stem for d in job_search_path() if d.is_dir() for p in d.glob("*.py") if p.stem != "__init__"})


def find_job(job: str) -> JobFiles:
    """`digits` -> jobs/digits.py + jobs/digits.yaml; a path to either file of a pair works too."""
    as_path = Path(job)
    if as_path.suffix in (".py", ".yaml", ".yml"):
        if not as_path.is_file():
            raise RecipeError(f"job file {job} does not exist")
        py = as_path.with_suffix(".py")
        if not py.is_file():
            raise RecipeError(f"job {job}: the recipe {py} is missing (a job is a .py recipe plus its .yaml)")
        yaml_file = next((p for p in (py.with_suffix(".yaml"), py.with_suffix(".yml")) if p.is_file()), None)
        return JobFiles(py.stem, py, yaml_file)
    for directory in job_search_path():
        py = directory / f"{job}.py"
        if py.is_file():
            yaml_file = py.with_suffix(".yaml")
            return JobFiles(job, py, yaml_file if yaml_file.is_file() else None)
    known = ", ".join(available_jobs()) or "(none found)"
    raise RecipeError(f"unknown job '{job}'; known jobs: {known}; or pass a path to a job's .py or .yaml file")


def load(job: str | JobFiles) -> Recipe:
    """Import a job's recipe (a name, a path, or the files `find_job` found) and check its contract."""
    files = job if isinstance(job, JobFiles) else find_job(job)
    module = _import(files)
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if not callable(getattr(module, "log_model", None)) and not callable(getattr(module, "model_input", None)):
        missing.append("model_input (or log_model)")
    if missing:
        raise RecipeError(f"recipe {files.recipe} must define {', '.join(missing)} (see raytrain_ddp/config/recipe.py)")
    not_callable = [
        name for name in OPTIONAL if getattr(module, name, None) is not None and not callable(getattr(module, name))
    ]
    if not_callable:
        raise RecipeError(
            f"recipe {files.recipe}: {', '.join(not_callable)} must be a function (see raytrain_ddp/config/recipe.py)"
        )
    return Recipe(
        files.name, *(getattr(module, name) for name in REQUIRED), *(getattr(module, name, None) for name in OPTIONAL)
    )


def _import(files: JobFiles) -> ModuleType:
    module_name = f"raytrain_ddp_job_{files.name}"
    module = sys.modules.get(module_name)
    if module is None or Path(module.__file__).resolve() != files.recipe.resolve():
        spec = importlib.util.spec_from_file_location(module_name, files.recipe)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise RecipeError(f"recipe {files.recipe} failed to import: {type(e).__name__}: {e}") from e
        import ray.cloudpickle

        # Ship the recipe's code to the workers with its functions instead of requiring jobs/ there.
        ray.cloudpickle.register_pickle_by_value(module)
    return module


def _with_service_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any], **service: Any) -> dict[str, Any]:
    """`kwargs`, plus those of the service's keywords that `fn` names."""
    names = inspect.signature(fn).parameters
    return kwargs | {k: v for k, v in service.items() if k in names}


def kwargs_schema(function: str, signature: inspect.Signature) -> type[BaseModel]:
    """The pydantic model of the settings of a recipe's `function` (build_model or build_datasets):
    its keyword arguments but the service's own."""
    fields = {}
    for name, param in signature.parameters.items():
        if name in SERVICE_KWARGS[function] or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (annotation, default)
    return create_model(
        f"{function}_kwargs",
        __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True),
        **fields,
    )
