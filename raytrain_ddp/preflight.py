"""What is checked before any training worker starts, so that bad input costs seconds and writes nothing.

Before Ray starts (`check_before_ray`): a run another live driver holds, a RAY_ADDRESS where no cluster
answers, a tracking server that cannot be reached or refuses the credentials, storage that would vanish
with the job. Then, with the plan in
hand (`check`): the recipe on two validation rows, the score metric, whether the cluster can ever hold
the workers, whether every node sees the storage. What a resumed run may not change (`resume_conflicts`)
is refused before Ray starts too, once the run's checkpoint is read (plan.stand). Every problem is
reported at once, as one ConfigError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray
import ray.data
import torch
from ray.data.dataset import MaterializedDataset

from raytrain_ddp import lease, ray_address, session, storage, tracking
from raytrain_ddp.config import Config, ConfigError, flatten
from raytrain_ddp.metrics import reported_metrics
from raytrain_ddp.recipe import Recipe

if TYPE_CHECKING:
    from raytrain_ddp.plan import Plan

# Keys a resumed run may change: they do not change what is computed, only how long, where, and what
# is kept or logged. Anything else would be silently overridden by the restored optimizer state or
# break exact resume (data order depends on num_workers), so changing it means starting a new run.
RESUMABLE = (
    "train.epochs",
    "train.eval_batch_size",
    "train.num_loader_workers",
    "scaling.use_gpu",
    "scaling.resources_per_worker",
    "ddp.bucket_cap_mb",
    "ddp.gradient_as_bucket_view",
    "ddp.find_unused_parameters",
    "ddp.static_graph",
    "checkpoint.",
    "run.storage_path",
    "run.max_failures",
    "run.controller_poll_s",
    "mlflow.",
)


def check_before_ray(config: Config, run_path: str) -> ray_address.RayAddress:
    """Raise RunBusy if another live driver trains the run, ConfigError for a RAY_ADDRESS where no
    cluster answers, a tracking server that cannot be used or paths that would not outlast the job:
    seconds, before Ray starts. Returns the Ray to join."""
    lease.check(run_path)
    address = session.ray_address()
    server = tracking.check_server(config.mlflow.tracking_uri)
    if problems := check_lasting_paths(config) + [p for p in (address.problem, server) if p]:
        raise ConfigError(config.job, problems)
    return address


def check(plan: Plan) -> None:
    """Everything else that can rule the run out without starting a worker, reported at once."""
    config = plan.config
    problems = (
        check_recipe(config, plan.recipe, plan.example)
        + check_resources(config, plan.datasets)
        + storage.check_shared(config.run.storage_path)
    )
    if problems:
        raise ConfigError(config.job, problems)


def check_recipe(config: Config, recipe: Recipe, example: dict[str, torch.Tensor]) -> list[str]:
    """The recipe runs on two validation rows, returns a scalar loss (or a sum and its count), and
    reports the score metric. A recipe with a model too big for the driver is run on its architecture
    alone (build_empty_model, on PyTorch's meta device): shapes and contract, not values."""
    try:  # a model on the meta device takes the CPU rows and computes on meta tensors
        model = recipe.make_model(config, empty=recipe.holds_large_model).eval()
        with torch.no_grad():
            loss = recipe.compute_loss(model, example)
            val_names = list(recipe.evaluate(model, example).keys())
    except Exception as e:  # noqa: BLE001 - the recipe's own message says what is wrong
        return [f"recipe {recipe.name} fails on two validation rows: {type(e).__name__}: {e}"]
    problems = []
    if not (_is_scalar(loss) or isinstance(loss, tuple) and len(loss) == 2 and _is_scalar(loss[0])):
        problems.append(
            f"recipe {recipe.name}: compute_loss must return a scalar tensor (a mean) or (sum, count), got {loss!r:.80}"
        )
    if recipe.derived_metrics is not None:
        val_names += list(recipe.derived_metrics(dict.fromkeys(val_names, 1.0)))
    reported = reported_metrics(val_names, counts_tokens=recipe.count_tokens is not None)
    if config.checkpoint.score_attribute not in reported:
        problems.append(
            f"checkpoint.score_attribute: {config.checkpoint.score_attribute!r} is not a reported metric; "
            f"choose one of: {', '.join(sorted(reported))}"
        )
    return problems


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0


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
    """Whether the cluster can ever place the workers. Ray would otherwise wait forever, silently, for
    resources that will not come."""
    s = config.scaling
    per_worker = dict(s.resources_per_worker) | ({"GPU": s.resources_per_worker.get("GPU", 1.0)} if s.use_gpu else {})
    autoscaler = _autoscaler_config()
    nodes = _node_shapes(autoscaler)
    capacity = {key: sum(node.get(key, 0.0) * count for node, count in nodes) for key in {"CPU", *per_worker}}
    where = ("at most, with the autoscaler" if autoscaler else f"{len(nodes)} node(s)") + f": {_describe(capacity)}"
    problems = []
    for key, amount in per_worker.items():
        if amount * s.num_workers > capacity.get(key, 0.0):
            fix = (
                "set scaling.use_gpu=false"
                if key == "GPU" and capacity.get("GPU", 0) == 0
                else ("lower scaling.num_workers or scaling.resources_per_worker")
            )
            problems.append(
                f"scaling: {s.num_workers} workers × {key} {amount:g} need {key} {amount * s.num_workers:g}, "
                f"the cluster has {capacity.get(key, 0.0):g} ({where}); {fix}"
            )
    if not problems and not any(all(node.get(k, 0.0) >= v for k, v in per_worker.items()) for node, _ in nodes):
        problems.append(
            f"scaling.resources_per_worker: no node can hold one worker's {_describe(per_worker)} "
            f"(nodes: {'; '.join(_describe(node) for node, _ in nodes)})"
        )
    lazy = [
        name
        for name, ds in datasets.items()
        if isinstance(ds, ray.data.Dataset) and not isinstance(ds, MaterializedDataset)
    ]
    left = capacity.get("CPU", 0.0) - per_worker.get("CPU", 0.0) * s.num_workers
    if not problems and lazy and left < 1:
        problems.append(
            f"scaling.resources_per_worker: the workers take {capacity['CPU'] - left:g} of {capacity['CPU']:g} CPUs, "
            f"and Ray Data needs one to run the pipeline of the unmaterialized dataset(s) {', '.join(lazy)}: "
            "without it training waits forever; lower resources_per_worker.CPU (e.g. {CPU: 0.5}), "
            "or materialize them"
        )
    return problems


def resume_conflicts(saved: Mapping[str, Any], config: Config) -> list[str]:
    """What `config` changes, against the config saved in the run's latest checkpoint, that a resume
    may not change; one line per key."""
    before = {".".join(path): value for path, value in flatten(saved).items()}
    after = config.flat()
    return [
        f"{key}: was {before.get(key)!r} when the run started, now {after.get(key)!r}; a resumed run keeps it"
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key) and not key.startswith(RESUMABLE)
    ]


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


def _autoscaler_config():
    """The autoscaler's cluster config (node types, max counts), or None without an autoscaler. Ray
    Train reads the same record for its own, later, check; there is no public API for it."""
    from ray._private.state import state

    try:
        return state.get_cluster_config()
    except Exception:  # noqa: BLE001 - no autoscaler: judge by the nodes there are
        return None


def _describe(resources: dict[str, float]) -> str:
    shown = {
        k: v
        for k, v in resources.items()
        if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store"))
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items()) if v) or "nothing"
