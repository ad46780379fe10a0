"""The recipe checked on two validation rows before any worker starts: every function called as a worker
would call it (a broken recipe is a RecipeFailed naming function, file and line), what it reports, and
what one training step of it costs (its FLOPs, worker/flops.py)."""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raytrain_ddp.config.layering import yaml_value
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config, ConfigError
from raytrain_ddp.worker import flops, sharding
from raytrain_ddp.worker.flops import ModelFlops
from raytrain_ddp.worker.metrics import reported_metrics


@dataclass(frozen=True)
class RecipeCheck:
    """What checking a recipe found: the metrics every report will carry, and what a training step costs."""

    reported: set[str]
    flops: ModelFlops


class RecipeFailed(ConfigError):
    """The recipe breaks its contract on real rows: each problem names the function, its file and line."""

    def __init__(self, recipe: Recipe, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        ValueError.__init__(self, f"recipe error in job '{recipe.name}' ({len(problems)} problem(s)):\n{lines}")


def check_recipe(config: Config, recipe: Recipe, example: dict[str, torch.Tensor], fitted: Any = None) -> RecipeCheck:
    """The whole contract on two validation rows, as training will call it: build_model, compute_loss
    in training mode (a finite scalar, or (sum, count), with a gradient), evaluate (a mapping of
    (sum, count) pairs, with the score metric among what is reported), model_input (the logged
    model's input runs through the model) and the optional hooks. Then, the recipe kept, one training
    step's FLOPs are counted on the same rows (or taken from count_flops: flops.py). Returns the
    metrics every report will carry and those FLOPs; raises RecipeFailed with every problem, each
    naming the recipe's function and the line of its file where it failed. A recipe with a model too
    big for the driver is run on its architecture alone (build_empty_model, on PyTorch's meta device):
    shapes and contract, not values or gradients."""
    meta = recipe.holds_large_model
    calls = _RecipeCalls(recipe)
    model = calls.run("build_empty_model" if meta else "build_model", recipe.make_model, config, fitted, empty=meta)
    if model is None:
        raise RecipeFailed(recipe, calls.problems)
    if config.scaling.strategy == "fsdp" and recipe.shard_blocks is not None:
        calls.expect("shard_blocks", calls.run("shard_blocks", _blocks_problem, recipe, model))
    loss = calls.run("compute_loss", _training_loss, recipe, model, example, meta)
    if loss is not None:
        calls.expect("compute_loss", _loss_problem(loss, meta))
    model.eval()
    with torch.no_grad():
        metrics = calls.run("evaluate", recipe.evaluate, model, example)
        if recipe.model_input is not None and recipe.log_model is None and not meta:
            output = calls.run("model_input", lambda: model(recipe.model_input(example)))
            calls.expect("model_input", _class_names_problem(config, output))
        if recipe.generate_samples is not None and not meta:
            calls.run("generate_samples", recipe.generate_samples, model, example)
    tokens = None
    if recipe.count_tokens is not None:
        tokens = calls.run("count_tokens", recipe.count_tokens, example)
        if tokens is not None and not _is_count(tokens):
            calls.expect("count_tokens", f"must return an int, got {tokens!r:.80}")
    if metrics is not None:
        calls.expect("evaluate", _metrics_problem(metrics))
    if calls.problems:
        raise RecipeFailed(recipe, calls.problems + mismatch_hint(config, example, calls.errors))
    val_names = list(metrics)
    if recipe.derived_metrics is not None:
        val_names += list(calls.run("derived_metrics", recipe.derived_metrics, dict.fromkeys(val_names, 1.0)) or {})
    model_flops = _model_flops(calls, recipe, model, example, tokens, config.scaling.use_gpu)
    if calls.problems:
        raise RecipeFailed(recipe, calls.problems)
    counts_tokens = recipe.count_tokens is not None
    return RecipeCheck(reported_metrics(val_names, counts_tokens, counts_flops=model_flops.known), model_flops)


def _blocks_problem(recipe: Recipe, model: torch.nn.Module) -> str | None:
    """scaling.strategy=fsdp: what is wrong with the blocks the recipe names, if anything."""
    named = list(recipe.shard_blocks(model) or ())
    if named and not sharding.blocks(recipe, model):
        shown = ", ".join(getattr(n, "__name__", type(n).__name__) for n in named[:5])
        return (
            f"names {shown}, and the model ({type(model).__name__}) holds none of them: return the classes of "
            "its repeated blocks (or the blocks), or nothing to shard the model at its root alone"
        )
    return None


def check_score(config: Config, reported: set[str]) -> list[str]:
    if config.checkpoint.score_attribute in reported:
        return []
    return [
        f"checkpoint.score_attribute: {config.checkpoint.score_attribute!r} is not a reported metric; "
        f"choose one of: {', '.join(sorted(reported))}"
    ]


class _RecipeCalls:
    """Calls into a recipe that turn its exceptions and wrong answers into problems naming the
    function, and the recipe file's line: where it raised, or where the function starts."""

    def __init__(self, recipe: Recipe):
        self.recipe, self.problems, self.errors = recipe, [], []

    def run(self, name: str, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the recipe's own error, located in its file
            self.problems.append(f"{self._where(name, e)} raised {type(e).__name__}: {e}")
            self.errors.append(e)
            return None

    def expect(self, name: str, problem: str | None) -> None:
        if problem is not None:
            self.problems.append(f"{self._where(name)} {problem}")

    def _where(self, name: str, error: BaseException | None = None) -> str:
        return where(getattr(self.recipe, name), name, error)


# torch's words for rows the model cannot take: a shape (channels, features, classes) or a dtype.
_MISMATCH = re.compile(r"shape|size|channels|dimension|mat1|dtype|scalar type|expected", re.IGNORECASE)


def mismatch_hint(config: Config, example: Mapping[str, torch.Tensor], errors: list[BaseException]) -> list[str]:
    """Where torch refused the data's rows for the model's shape or dtype: what each side is and the
    settings that decide it (the data: dataset.*, the model: model.*), so the message names the key to set."""
    if not any(isinstance(e, RuntimeError) and _MISMATCH.search(str(e)) for e in errors):
        return []
    rows = ", ".join(
        f"{name} {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
        for name, t in example.items()
        if isinstance(t, torch.Tensor)
    )
    settings = ", ".join(
        f"{section}.{k}={yaml_value(v)}"
        for section in ("dataset", "model")
        for k, v in getattr(config, section).items()
    )
    return [
        f"the data and the model disagree: two validation rows are {rows}, and the model is built for something "
        f"else; the settings that decide them: {settings}; set the model.* key that matches the data "
        f"(channels, features, classes), or the dataset.* key that gives the rows the model expects"
    ]


def where(fn: Any, name: str, error: BaseException | None = None) -> str:
    """`name (file, line N: code)`: the recipe's deepest line on the way to `error`, else where `fn` starts."""
    file, line = fn.__code__.co_filename, fn.__code__.co_firstlineno
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == file] if error else []
    if frames:
        return f"{name} ({_shown(file)}, line {frames[-1].lineno}: {frames[-1].line})"
    return f"{name} ({_shown(file)}, line {line})"


def _shown(file: str) -> str:
    path = Path(file)
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _training_loss(recipe: Recipe, model: torch.nn.Module, example: dict[str, torch.Tensor], meta: bool) -> Any:
    """compute_loss as training calls it: in training mode, with autograd (on a meta model, without)."""
    model.train()
    with torch.no_grad() if meta else contextlib.nullcontext():
        return recipe.compute_loss(model, example)


def _model_flops(
    calls: _RecipeCalls,
    recipe: Recipe,
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    tokens: int | None,
    gpu: bool,
) -> ModelFlops:
    """One training step's FLOPs on the example rows: the recipe's count_flops where it has one (a
    problem if it is not a positive number), else, for a run on GPUs, counted (flops.count, which
    never refuses a run). A CPU run counts nothing: it has no peak to measure them against, and the
    counter's first use would cost its driver a second (torch imports its compiler for it)."""
    if recipe.count_flops is None:
        if not gpu:
            return ModelFlops(missing="counted for runs on GPUs only (scaling.use_gpu=true): MFU needs a GPU's peak")
        return flops.count(recipe.compute_loss, model, example, tokens)
    step = calls.run("count_flops", recipe.count_flops, model, example)
    if step is None:
        return ModelFlops()
    if not _is_number(step) or not float(step) > 0:
        calls.expect("count_flops", f"must return the FLOPs of a training step on the batch (> 0), got {step!r:.80}")
        return ModelFlops()
    rows = len(next(iter(example.values())))
    return ModelFlops.of_step(float(step), rows, tokens, "the recipe's count_flops")


def _class_names_problem(config: Config, output: Any) -> str | None:
    """data.class_names names each of a classifier's outputs: as many as the model gives a row."""
    names = config.data.class_names
    if names is None or not isinstance(output, torch.Tensor) or output.ndim != 2 or output.shape[1] == len(names):
        return None
    return (
        f"gives {output.shape[1]} outputs a row, and data.class_names names {len(names)}: set one of them to "
        f"agree with the other (the model.* key of its classes, or data.class_names)"
    )


def _loss_problem(loss: Any, meta: bool) -> str | None:
    value = loss[0] if isinstance(loss, tuple) and len(loss) == 2 else loss
    if not _is_scalar(value):
        return f"must return a scalar tensor (a mean) or (sum, count), got {loss!r:.80}"
    if isinstance(loss, tuple) and not _is_count(loss[1]):
        return f"returned (sum, count) with count {loss[1]!r:.80}: the count must be an int or an integer tensor"
    if meta:
        return None
    if not torch.isfinite(value):
        return f"returned a loss of {value.item()} on two validation rows: it must be finite"
    if not value.requires_grad:
        return "returned a loss with no gradient (computed without the model, under no_grad, or detached)"
    return None


def _metrics_problem(metrics: Any) -> str | None:
    shape = "{name: (sum, count)}: the sum of the metric over the batch's rows, and how many they are"
    if not isinstance(metrics, Mapping) or not metrics:
        return f"must return {shape}, got {metrics!r:.80}"
    for name, pair in metrics.items():
        if not (isinstance(pair, tuple) and len(pair) == 2 and _is_number(pair[0]) and _is_count(pair[1])):
            return f"must return {shape}; {name!r} is {pair!r:.80}"
    return None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0


def _is_number(value: Any) -> bool:
    return _is_scalar(value) or isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.is_floating_point()
    return isinstance(value, int) and not isinstance(value, bool)
