"""What is checked before any training worker starts, so that bad input costs seconds and writes nothing.

Before Ray starts (`check_before_ray`): a run another live driver holds, a RAY_ADDRESS where no cluster
answers, a tracking server that cannot be reached or refuses the credentials, storage that would vanish
with the job, train.compile where torch cannot compile. Then, with the plan in hand (`check`): the
whole recipe on two validation rows (a broken recipe is a RecipeFailed naming function, file and line)
and what one training step of it costs (its FLOPs, flops.py), the score metric, batch arithmetic,
whether the cluster can ever hold the workers, whether every node sees the storage. What a resumed
run may not change (`resume_conflicts`) is refused before Ray starts too, once the run's checkpoint is
read (plan.stand). Every problem is reported at once, as one ConfigError.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.data
import torch
from ray.data.dataset import MaterializedDataset

from raytrain_ddp.checkpoint import lease, storage
from raytrain_ddp.cluster import capacity, ray_address, session
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config, ConfigError, flatten, worker_counts
from raytrain_ddp.data import stream
from raytrain_ddp.registry import endpoint
from raytrain_ddp.worker import flops
from raytrain_ddp.worker.flops import ModelFlops
from raytrain_ddp.worker.metrics import reported_metrics
from raytrain_ddp.worker.optim import batches_per_epoch, optimizer_steps

# Keys a resumed run may change: they do not change what is computed, only how long, where, and what
# is kept or logged. Anything else would be silently overridden by the restored optimizer state or
# break exact resume, so changing it means starting a new run. The number of workers is the one
# exception, with its own rule (`_resized`): it may change at an epoch's end, keeping the global batch.
RESUMABLE = (
    "train.epochs",
    "train.early_stopping.",
    "train.eval_batch_size",
    "train.num_loader_workers",
    "scaling.use_gpu",
    "scaling.resize_check_s",
    "scaling.resources_per_worker",
    "data.",
    "ddp.bucket_cap_mb",
    "ddp.gradient_as_bucket_view",
    "ddp.find_unused_parameters",
    "ddp.static_graph",
    "checkpoint.",
    "run.storage_path",
    "run.max_failures",
    "run.controller_poll_s",
    "run.resources_wait_s",
    "run.prestart_workers",
    "run.progress_",
    "mlflow.",
)


def check_before_ray(config: Config, run_path: str) -> ray_address.RayAddress:
    """Raise RunBusy if another live driver trains the run, ConfigError for a RAY_ADDRESS where no
    cluster answers, a tracking server that cannot be used, paths that would not outlast the job or
    train.compile on a machine that cannot compile: seconds, before Ray starts. Returns the Ray to join."""
    lease.check(run_path)
    address = session.ray_address()
    server = endpoint.check_server(config.mlflow.tracking_uri)
    if problems := check_lasting_paths(config) + check_compile(config) + [p for p in (address.problem, server) if p]:
        raise ConfigError(config.job, problems)
    return address


def check_compile(config: Config) -> list[str]:
    """What train.compile needs of the machine, checked on the driver's (the workers' nodes are
    expected to run the same image): a Python that torch.compile supports and, to train on CPU, a
    C++ compiler for inductor's kernels (on GPU it writes Triton kernels, shipped with torch)."""
    if not config.train.compile:
        return []
    if not torch._dynamo.is_dynamo_supported():
        python = sys.version.split()[0]
        return [f"train.compile: torch {torch.__version__} cannot compile on Python {python}; set train.compile=false"]
    if config.scaling.use_gpu:
        return []
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler, or whatever else stops it finding one
        return [
            f"train.compile: compiling for CPU needs a C++ compiler and none works on this machine ({e}); "
            "install g++ (apt-get install g++), set CXX to one, or set train.compile=false"
        ]
    return []


def check(
    config: Config,
    recipe: Recipe,
    datasets: dict[str, Any],
    *,
    example: dict[str, torch.Tensor],
    fitted: Any,
    train_rows: int,
    saved_config: Mapping[str, Any] | None,
) -> ModelFlops:
    """Everything else that can rule the run out without starting a worker, reported at once.
    Returns what a training step of the model costs, found on the way (flops.py)."""
    checked = check_recipe(config, recipe, example, fitted)
    problems = (
        check_score(config, checked.reported)
        + check_batches(config, train_rows)
        + check_steps(config, saved_config, train_rows)
        + check_resources(config, datasets)
        + check_labels(config)
        + check_free_now(config)
        + storage.check_shared(config.run.storage_path)
    )
    if problems:
        raise ConfigError(config.job, problems)
    return checked.flops


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
    loss = calls.run("compute_loss", _training_loss, recipe, model, example, meta)
    if loss is not None:
        calls.expect("compute_loss", _loss_problem(loss, meta))
    model.eval()
    with torch.no_grad():
        metrics = calls.run("evaluate", recipe.evaluate, model, example)
        if recipe.model_input is not None and recipe.log_model is None and not meta:
            calls.run("model_input", lambda: model(recipe.model_input(example)))
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
        raise RecipeFailed(recipe, calls.problems)
    val_names = list(metrics)
    if recipe.derived_metrics is not None:
        val_names += list(calls.run("derived_metrics", recipe.derived_metrics, dict.fromkeys(val_names, 1.0)) or {})
    model_flops = _model_flops(calls, recipe, model, example, tokens, config.scaling.use_gpu)
    if calls.problems:
        raise RecipeFailed(recipe, calls.problems)
    counts_tokens = recipe.count_tokens is not None
    return RecipeCheck(reported_metrics(val_names, counts_tokens, counts_flops=model_flops.known), model_flops)


def check_score(config: Config, reported: set[str]) -> list[str]:
    if config.checkpoint.score_attribute in reported:
        return []
    return [
        f"checkpoint.score_attribute: {config.checkpoint.score_attribute!r} is not a reported metric; "
        f"choose one of: {', '.join(sorted(reported))}"
    ]


def check_batches(config: Config, train_rows: int) -> list[str]:
    """Batch arithmetic per worker, on each number of workers the run may have (the most first: the
    fewest rows each): an epoch of no step is refused, a batch larger than a worker's share of the
    rows is named (each epoch would be one short step)."""
    for workers in reversed(worker_counts(config.scaling.num_workers)):
        if problems := _batches_on(config, train_rows, workers):
            return problems
    return []


def _batches_on(config: Config, train_rows: int, workers: int) -> list[str]:
    t, accumulation = config.train, config.accumulation_on(workers)
    rows = train_rows // workers
    batches = batches_per_epoch(train_rows, workers, t.batch_size, t.drop_last)
    share = f"{train_rows} training rows over {workers} workers are {rows} per worker"
    if batches == 0:
        return [
            f"train.batch_size: {share}, fewer than one batch of {t.batch_size}"
            + (" with train.drop_last=true" if t.drop_last else "")
            + f": an epoch would train nothing; use train.batch_size <= {max(rows, 1)} or fewer workers"
        ]
    problems = []
    if t.batch_size > rows:
        problems.append(
            f"train.batch_size: {share}, fewer than one batch of {t.batch_size}: each epoch would be one short "
            f"step of {rows} rows per worker; use train.batch_size <= {rows}"
        )
    if accumulation > batches:
        s = config.scaling
        per_step = (
            f"{t.grad_accum_steps} on {s.max_workers} workers, {accumulation} micro-batches per step on {workers}"
            if s.elastic
            else f"{accumulation} micro-batches per step"
        )
        problems.append(
            f"train.grad_accum_steps: {per_step}, but each worker has {batches} batch(es) of {t.batch_size} an "
            f"epoch; lower it to <= {batches * workers // s.max_workers} or the batch size"
        )
    return problems


def check_steps(config: Config, saved: Mapping[str, Any] | None, train_rows: int) -> list[str]:
    """Every number of workers a run may train on (each of an elastic range, and the one it ran on
    before a resume: `_resized`) must make the same optimizer steps an epoch, or the learning-rate
    schedule and the step count would depend on it: how the rows round into batches may differ."""
    t, s = config.train, config.scaling

    def steps(workers: int, per_step: int) -> int:
        return optimizer_steps(batches_per_epoch(train_rows, workers, t.batch_size, t.drop_last), per_step // workers)

    per_step = config.micro_batches_per_step
    made = {workers: steps(workers, per_step) for workers in worker_counts(s.num_workers)}  # one count, or each
    if len(set(made.values())) > 1:
        shown = ", ".join(f"{n} on {w} × {per_step // w}" for w, n in made.items())
        fix = "set train.drop_last=true or a" if not t.drop_last else "choose a"
        return [
            f"scaling.num_workers={list(s.num_workers)}: {train_rows} training rows make a different number of "
            f"optimizer steps an epoch on each count of workers ({shown} micro-batches a step): the learning-rate "
            f"schedule would depend on it; {fix} train.batch_size that splits the rows the same way on each"
        ]
    if saved is None:
        return []
    was = (max(worker_counts(saved["scaling"]["num_workers"])), saved["train"].get("grad_accum_steps", 1))
    made_before = steps(was[0], was[0] * was[1])
    if made_before == made[s.max_workers]:
        return []
    return [
        f"scaling.num_workers: {train_rows} training rows make {made[s.max_workers]} optimizer steps an epoch on "
        f"{s.max_workers} workers × train.grad_accum_steps {t.grad_accum_steps}, the run made {made_before} on "
        f"{was[0]} × {was[1]}: its learning-rate schedule would shift; resume on a number of workers that splits "
        "the rows the same way"
    ]


class _RecipeCalls:
    """Calls into a recipe that turn its exceptions and wrong answers into problems naming the
    function, and the recipe file's line: where it raised, or where the function starts."""

    def __init__(self, recipe: Recipe):
        self.recipe, self.problems = recipe, []

    def run(self, name: str, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the recipe's own error, located in its file
            self.problems.append(f"{self._where(name, e)} raised {type(e).__name__}: {e}")
            return None

    def expect(self, name: str, problem: str | None) -> None:
        if problem is not None:
            self.problems.append(f"{self._where(name)} {problem}")

    def _where(self, name: str, error: BaseException | None = None) -> str:
        return where(getattr(self.recipe, name), name, error)


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


def check_lasting_paths(config: Config) -> list[str]:
    """Under `ray job submit` the driver runs in a copy of the working directory that Ray deletes
    after the job: the relative defaults (./runs, sqlite:///mlflow.db) would vanish with it."""
    temporary = "/runtime_resources/"  # where Ray unpacks a job's working_dir, in its session directory
    problems = []
    if temporary in config.run.storage_path:
        problems.append(
            f"run.storage_path: {config.run.storage_path} is in the job's temporary working directory, which Ray "
            "deletes when the job ends; set run.storage_path to storage that outlasts it (s3://bucket/runs, "
            "a shared mount)"
        )
    if config.mlflow.tracking_uri.startswith("sqlite:") and temporary in config.mlflow.tracking_uri:
        problems.append(
            f"mlflow.tracking_uri: {config.mlflow.tracking_uri} is in the job's temporary working directory, which Ray "
            "deletes when the job ends; set mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to a tracking server"
        )
    return problems


def check_resources(config: Config, datasets: dict[str, Any]) -> list[str]:
    """Whether the cluster can ever place the workers (an elastic run's least). Ray would otherwise wait
    forever, silently, for resources that will not come."""
    s, per_worker = config.scaling, capacity.per_worker(config)
    autoscaler = session.autoscaler_config()
    nodes = _node_shapes(autoscaler)
    most = {key: sum(node.get(key, 0.0) * count for node, count in nodes) for key in {"CPU", *per_worker}}
    where = ("at most, with the autoscaler" if autoscaler else f"{len(nodes)} node(s)") + f": {_describe(most)}"
    problems = []
    for key, amount in per_worker.items():
        if amount * s.min_workers > most.get(key, 0.0):
            fix = (
                "set scaling.use_gpu=false"
                if key == "GPU" and most.get("GPU", 0) == 0
                else ("lower scaling.num_workers or scaling.resources_per_worker")
            )
            problems.append(
                f"scaling: {s.min_workers} workers × {key} {amount:g} need {key} {amount * s.min_workers:g}, "
                f"the cluster has {most.get(key, 0.0):g} ({where}); {fix}"
            )
    if not problems and not any(all(node.get(k, 0.0) >= v for k, v in per_worker.items()) for node, _ in nodes):
        problems.append(
            f"scaling.resources_per_worker: no node can hold one worker's {_describe(per_worker)} "
            f"(nodes: {'; '.join(_describe(node) for node, _ in nodes)})"
        )
    lazy = [
        name
        for name, ds in datasets.items()
        if isinstance(ds, stream.Stream)
        or (isinstance(ds, ray.data.Dataset) and not isinstance(ds, MaterializedDataset))
    ]
    placed = min([s.max_workers, *(int(most.get(k, 0.0) // v) for k, v in per_worker.items() if v > 0)])
    left = most.get("CPU", 0.0) - per_worker.get("CPU", 0.0) * placed
    if not problems and lazy and left < 1:
        problems.append(
            f"scaling.resources_per_worker: the workers take {most['CPU'] - left:g} of {most['CPU']:g} CPUs, "
            f"and Ray Data needs one to run the pipeline of the streamed or unmaterialized dataset(s) "
            f"{', '.join(lazy)}: "
            "without it training waits forever; lower resources_per_worker.CPU (e.g. {CPU: 0.5}), "
            "or materialize them"
        )
    return problems


def check_free_now(config: Config) -> list[str]:
    """With run.resources_wait_s=0, whether the workers fit in what the cluster has free now (another
    run may hold it): refused at once rather than waiting."""
    if config.run.resources_wait_s > 0 or capacity.fits_now(config):
        return []
    return [
        f"run.resources_wait_s=0 and the workers do not fit now: {capacity.describe_wait(config)}; "
        "wait for the resources to be free, or set run.resources_wait_s to how long the run may wait for them"
    ]


def check_labels(config: Config) -> list[str]:
    """Whether a node has the labels that scaling.label_selector and data.label_selector ask for (with an
    autoscaler: a node type has them). Ray would otherwise wait forever for a node that will not come."""
    autoscaler = session.autoscaler_config()
    if autoscaler is not None and autoscaler.node_group_configs:
        found = [getattr(group, "labels", None) for group in autoscaler.node_group_configs]
    else:
        found = [node.get("Labels") for node in ray.nodes() if node["Alive"]]
    if any(labels is None for labels in found):  # this Ray does not say: nothing to check against
        return []
    nodes = [dict(labels) for labels in found]
    problems = []
    asked = {"scaling.label_selector": config.scaling.label_selector, "data.label_selector": config.data.label_selector}
    for key, selector in asked.items():
        if selector and not any(capacity.has_labels(labels, selector) for labels in nodes):
            wanted, has = capacity.labels_text(selector), "; ".join(capacity.labels_text(n) or "none" for n in nodes)
            problems.append(
                f"{key}: no node of the cluster has the labels {wanted} (they have: {has}); "
                f"start nodes with --labels {wanted}, or clear {key}"
            )
    return problems


def resume_conflicts(saved: Mapping[str, Any], config: Config) -> list[str]:
    """What `config` changes, against the config saved in the checkpoint the run resumes from, that a
    resume may not change; one line per key."""
    before = {".".join(path): value for path, value in flatten(saved).items()}
    after = config.flat()
    # A key the saved config lacks was added to the schema after the run started, which then
    # trained as its default says (train.compile: false).
    defaults = Config(job=config.job).flat()
    was = {key: before.get(key, defaults.get(key)) for key in set(before) | set(after)}
    resizing = ("scaling.num_workers", "train.grad_accum_steps")
    return _resized(*(was[key] for key in resizing), config) + [
        f"{key}: was {was[key]!r} when the run started, now {after.get(key)!r}; a resumed run keeps it"
        for key in sorted(was)
        if was[key] != after.get(key) and not key.startswith(RESUMABLE) and key not in resizing
    ]


def _resized(workers: int | Sequence[int], accumulation: int, config: Config) -> list[str]:
    """A run may resume on another number of workers, or range of them, keeping its global batch
    (batch_size × max workers × grad_accum_steps rows a step): the same optimizer steps an epoch, the
    same schedule, and each rank's share of an epoch drawn afresh from (seed, epoch). It resumes at an
    epoch's end: a mid-epoch position names what each of the old ranks had read
    (`checkpoint.resumable_on`). An elastic run resizes by the same rule (`Config.accumulation_on`)."""
    per_step = max(worker_counts(workers)) * accumulation
    if config.micro_batches_per_step == per_step:
        return []
    most, at_most = config.scaling.max_workers, " at most" if config.scaling.elastic else ""
    fix = (
        f"with {most} workers{at_most} set train.grad_accum_steps={per_step // most}"
        if per_step % most == 0
        else f"use a number of workers that divides {per_step}"
    )
    was = f"{_counted(workers)} × train.grad_accum_steps {accumulation}"
    now = f"{_counted(config.scaling.num_workers)} × train.grad_accum_steps {config.train.grad_accum_steps}"
    return [
        f"scaling.num_workers: the run steps on {per_step} micro-batches of train.batch_size ({was}); "
        f"{now} would change its global batch: {fix}"
    ]


def _counted(workers: int | Sequence[int]) -> str:
    return f"{workers} workers" if isinstance(workers, int) else f"{workers[0]}–{workers[1]} workers"


def _node_shapes(config) -> list[tuple[dict[str, float], int]]:
    """(resources of one node, how many such nodes): the autoscaler's node types at their maximum
    counts where the cluster autoscales, else the nodes alive now."""
    if config is not None and config.node_group_configs:
        unlimited = 10**6
        return [
            (dict(group.resources), unlimited if group.max_count < 0 else group.max_count)
            for group in config.node_group_configs
        ]
    return [(node["Resources"], 1) for node in ray.nodes() if node["Alive"]]


def _describe(resources: dict[str, float]) -> str:
    shown = {
        k: v
        for k, v in resources.items()
        if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store"))
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items()) if v) or "nothing"
