"""Registering a run's model: the best of its checkpoints that verifies (best by `checkpoint.rank`, the
rule the console's ★ follows), logged to MLflow with an input example and registered as a new
version of `mlflow.model_name`, as `mlflow.register` says: always, if_better (only if its score beats
the latest version's), or never. `driver.run` does it when training finishes; `register(run_path)`
does it later, whatever the policy, for a run that was not registered (the tracking server was
down, say, or the policy said no). Both go through `register_best`. Each version carries its
lineage as tags (`lineage`: run, config, code, data, versions) and moves the model's `champion`
alias if it beats the champion (champion.py; `raytrain-ddp promote` moves it by hand).

    raytrain-ddp register runs/<name>
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import shlex
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import ray
import ray.train
import torch
from rich.console import Console
from rich.markup import escape

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.checkpoint import lease
from raytrain_ddp.cluster import session
from raytrain_ddp.config import layering
from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config
from raytrain_ddp.controller.callbacks import one_line
from raytrain_ddp.data import datasets as data
from raytrain_ddp.driver import plan as planning
from raytrain_ddp.driver import prepare
from raytrain_ddp.driver.plan import Plan
from raytrain_ddp.driver.timeline import Timeline
from raytrain_ddp.errors import RegistrationFailed
from raytrain_ddp.registry import endpoint, model_logging, model_registry, records, tracking

Policy = Literal["always", "if_better", "never"]
NEVER = "not registered (mlflow.register=never)"


@dataclass(frozen=True)
class Registration:
    checkpoint: str  # the run's best checkpoint (the one registered, if one was): a path, or a URI
    metrics: dict[str, Any]  # reported with it
    model: records.RegisteredModel | None  # None: not registered; `note` says why and how to register it
    note: str  # what was decided and why, in a line ("" for a plain new version)
    artifacts: list[str]  # the recipe's text artifacts, logged beside the model


def register(
    run_path: str, *, tracking_uri: str | None = None, verbose: bool = False, console: Console | None = None
) -> records.RegisteredModel:
    """Register the best checkpoint of a run that finished training but whose model was not
    registered, with the config saved in its checkpoints, into `tracking_uri` (default: the one the
    run used), whatever its `mlflow.register` said. Idempotent: a version this run already registered
    for that checkpoint is returned, not duplicated."""
    console = console or Console(soft_wrap=True)
    with session.bounded_mlflow_retries():
        config = planning.finished_config(run_path, tracking_uri)
        registration, run_id = register_finished(config, "always", verbose=verbose, console=console)
    model = registration.model
    note = f" ({registration.note})" if registration.note else ""
    fared = f"; {model.champion}" if model.champion else ""
    console.print(
        f"{config.run.name}: {registration.checkpoint} is [bold]{model.name}[/] version {model.version} ({model.uri})"
        f"{escape(note + fared)}; MLflow run {run_id} in {config.mlflow.tracking_uri}"
    )
    return model


def register_finished(
    config: Config, policy: Policy, *, verbose: bool, console: Console
) -> tuple[Registration, str | None]:
    """Register the best checkpoint of the finished run of `config` as `policy` says, and the id of its
    MLflow run. What is decided already (a version registered for it, or a policy that says no) is
    answered from the run's record and the registry, without Ray."""
    standing = planning.stand(config)
    registration = decided_already(standing)
    if registration is not None and (registration.model is not None or policy != "always"):
        return registration, tracking.find_run(standing.config, standing.run_path)
    plan = prepare.make(standing, verbose=verbose, console=console, clock=Timeline())
    with lease.Lease(plan.run_path):
        run_id = tracking.start_run(plan.config, plan.run_path)
        checkpoints = ckpt.reported(plan.run_path, ckpt.run_record(plan.run_path))
        return register_best(plan, checkpoints, run_id, console, policy=policy), run_id


def register_best(
    plan: Plan,
    checkpoints: Iterable[tuple[ray.train.Checkpoint, dict[str, Any]]],
    run_id: str,
    console: Console,
    policy: Policy,
) -> Registration:
    """Register the best of the run's (checkpoint, metrics) that verifies, as `policy` says, saying
    which better ones were damaged, and mark the MLflow run FINISHED. Raises RegistrationFailed, with
    the command that registers later, if MLflow fails on the way (the MLflow run is then marked FAILED)."""
    config = plan.config
    if (unreachable := endpoint.check_server(config.mlflow.tracking_uri)) is not None:
        # Asked once, without retries: each call below would retry for seconds and fail the same way.
        raise RegistrationFailed(_not_registered(plan, unreachable))
    try:
        with console.status("Registering the best checkpoint's model in MLflow…"):
            registration = _register(plan, checkpoints, run_id, console, policy)
        tracking.finish_run(config, run_id, "FINISHED")
    except Exception as e:
        if endpoint.check_server(config.mlflow.tracking_uri) is None:  # else marking it would fail the same way
            tracking.end_failed_run(config, run_id, "FAILED")
        raise RegistrationFailed(_not_registered(plan, one_line(e))) from e
    return registration


def _not_registered(plan: Plan, why: str) -> str:
    return (
        f"run {plan.config.run.name} finished training ({plan.config.train.epochs} epochs), but its model was not "
        f"registered: {why}\ncheckpoints: {plan.run_path}\n"
        f"register it later: {shlex.join(['raytrain-ddp', 'register', plan.run_path])}"
    )


def decided_already(standing: planning.Standing) -> Registration | None:
    """For a finished run, what registering its best checkpoint that verifies would decide, where that
    needs neither Ray nor the model: the version its MLflow run registered for it, or that it is not
    registered (mlflow.register=never, or if_better and the latest version's score is as good), and
    why. None where registration has work to do. Reads the run's record and the registry only."""
    config = standing.config
    run_id = tracking.find_run(config, standing.run_path)
    record = ckpt.run_record(standing.run_path)
    if run_id is None or record is None:
        return None
    ranked = [checkpoint for checkpoint, _ in _best_first(config, ckpt.reported(standing.run_path, record))]
    with ckpt.open_first_verified(ranked) as best:
        metrics = best.verified.metrics()
        if (model := model_registry.registered_version(config, run_id, best.location)) is not None:
            return Registration(best.location, metrics, model, "already registered", [])
    if config.mlflow.register == "always":
        return None
    anyway = shlex.join(["raytrain-ddp", "register", standing.run_path])
    if config.mlflow.register == "never":
        return Registration(best.location, metrics, None, f"{NEVER}; register it: {anyway}", [])
    register, note = _decide(config, metrics)
    return None if register else Registration(best.location, metrics, None, f"{note}; register it anyway: {anyway}", [])


def _best_first(config: Config, checkpoints: Iterable) -> list[tuple[ray.train.Checkpoint, dict[str, Any]]]:
    return ckpt.best_first(checkpoints, config.checkpoint.score_attribute, config.checkpoint.score_order)


def _decide(config: Config, metrics: dict[str, Any]) -> tuple[bool, str]:
    """mlflow.register=if_better's decision for a checkpoint reported with `metrics`, and its reason."""
    return is_better(config, _score(config, metrics))


def _score(config: Config, metrics: dict[str, Any]) -> records.Score:
    c = config.checkpoint
    return records.Score(c.score_attribute, c.score_order, float(metrics[c.score_attribute]))


def _register(plan: Plan, checkpoints: Iterable, run_id: str, console: Console, policy: Policy) -> Registration:
    config = plan.config
    best_first = _best_first(config, checkpoints)
    register_anyway = shlex.join(["raytrain-ddp", "register", plan.run_path])
    if policy == "never":  # nothing is read or asked of the registry: the best as Ray ranks it, unverified
        best, metrics = best_first[0]
        note = f"{NEVER}; register it: {register_anyway}"
        return Registration(ckpt.location(best), metrics, None, note, [])
    ranked = [checkpoint for checkpoint, _ in best_first]
    made_of = lineage(config, run_id, data.fingerprint(plan.datasets["train"], plan.train_rows))
    if plan.recipe.holds_large_model:  # where the memory is: a task with a training worker's resources
        s = config.scaling
        task = ray.remote(register_checkpoint).options(
            num_cpus=s.resources_per_worker.get("CPU", 1.0), num_gpus=1 if s.use_gpu else 0, max_retries=0
        )
        registration, skipped = ray.get(
            task.remote(config, plan.recipe, ranked, plan.example, run_id, policy, made_of, plan.fitted)
        )
    else:
        registration, skipped = register_checkpoint(
            config, plan.recipe, ranked, plan.example, run_id, policy, made_of, plan.fitted
        )
    for damaged in skipped:
        console.print(f"[yellow]skipped damaged checkpoint[/] {escape(str(damaged))}")
    if registration.model is None:
        return replace(registration, note=f"{registration.note}; register it anyway: {register_anyway}")
    return registration


def register_checkpoint(
    config: Config,
    recipe: Recipe,
    ranked: list[ray.train.Checkpoint],
    example: dict[str, torch.Tensor],
    run_id: str,
    policy: Literal["always", "if_better"],
    made_of: dict[str, str],
    fitted: Any = None,
) -> tuple[Registration, list[ckpt.Skipped]]:
    """Build the model, load the first of `ranked` that verifies, log it (the recipe's log_model, else
    as a PyTorch model with `example` as its input example) with the recipe's artifacts, and register
    it, tagged with `made_of` (its `lineage`). Returns the registration and the better checkpoints
    skipped as damaged. A checkpoint this run registered already is returned as it is, and one that
    `policy` if_better turns down is not registered; neither builds the model."""
    with ckpt.open_first_verified(ranked) as best:
        metrics = best.verified.metrics()
        if (registered := model_registry.registered_version(config, run_id, best.location)) is not None:
            note = "already registered: the run's best checkpoint is the one registered before"
            return Registration(best.location, metrics, registered, note, []), best.skipped
        register, note = _decide(config, metrics) if policy == "if_better" else (True, "")
        if not register:
            return Registration(best.location, metrics, None, note, []), best.skipped
        saved = json.dumps(best.verified.config(), sort_keys=True).encode()  # what trained it, resumes included
        made_of = {**made_of, "raytrain_ddp.config_sha256": hashlib.sha256(saved).hexdigest()}
        if names := config.data.class_names:
            made_of[records.CLASS_NAMES_TAG] = json.dumps(names)
        model = recipe.make_model(config, fitted)  # the checkpoint's buffers then replace what was fitted
        ckpt.load_weights(model, best.verified.model_state())
    model.eval()
    if recipe.log_model is not None:
        log = partial(recipe.log_model, model)
    elif config.data.class_names:  # two rows, so the exported model keeps a dynamic batch dimension
        rows = recipe.model_input(example).numpy()
        log = partial(model_logging.log_classifier, model, rows, config.data.class_names)
    else:
        log = partial(model_logging.log_pytorch_model, model, recipe.model_input(example).numpy())
    registered = model_registry.register_model(config, run_id, best.location, _score(config, metrics), log, made_of)
    artifacts = {records.CLASS_NAMES: json.dumps(config.data.class_names, indent=1)} if config.data.class_names else {}
    if recipe.artifacts is not None:
        with torch.no_grad():
            artifacts |= recipe.artifacts(model)
    tracking.log_texts(config, run_id, artifacts)
    return Registration(best.location, metrics, registered, note, sorted(artifacts)), best.skipped


def lineage(config: Config, run_id: str, data_fingerprint: str) -> dict[str, str]:
    """What a registered version was made of, as its tags (beside its checkpoint's and, added by
    `register_checkpoint`, the sha256 of the resolved config saved in that checkpoint, its JSON with
    keys sorted): the MLflow run, the recipe's code (`_code`), the training data's fingerprint
    (data.fingerprint, computed on the driver from the datasets as the config builds them now) and
    the versions of torch, Ray and this service. Cheap: no data is read, three git commands at most."""
    return {
        "raytrain_ddp.run_id": run_id,
        **_code(layering.origin_of(config).job.files.recipe),
        "raytrain_ddp.data_fingerprint": data_fingerprint,
        "raytrain_ddp.torch_version": torch.__version__,
        "raytrain_ddp.ray_version": ray.__version__,
        "raytrain_ddp.raytrain_ddp_version": service_version(),
    }


def service_version() -> str:
    """This service's installed version; where it runs from a checkout that was never installed (on
    PYTHONPATH), that, with where it was imported from: a tag must not cost a trained model its
    registration."""
    try:
        return importlib.metadata.version("raytrain-ddp")
    except importlib.metadata.PackageNotFoundError:
        return f"not installed: imported from {Path(__file__).parents[1]}"


def _code(recipe: Path) -> dict[str, str]:
    """The recipe file's sha256 and, where it lives in a git work tree, its commit and whether the tree
    differs from it (a changed tracked file, or the recipe itself untracked). Without git, or outside
    a repository, the hash alone."""
    found = {"raytrain_ddp.code_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    git = partial(subprocess.run, capture_output=True, text=True, check=True, timeout=30)
    where = ["git", "-C", str(recipe.parent)]
    try:
        commit = git([*where, "rev-parse", "HEAD"]).stdout.strip()
        changed = git([*where, "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        tracked = git([*where, "ls-files", "--", recipe.name]).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git, not a work tree, no commit yet
        return found
    dirty = str(bool(changed) or not tracked).lower()
    return found | {"raytrain_ddp.code_git_commit": commit, "raytrain_ddp.code_git_dirty": dirty}


def is_better(config: Config, score: records.Score) -> tuple[bool, str]:
    """mlflow.register=if_better: whether `score` beats the latest version's (strictly: an equal
    score adds nothing), and the reason in a line. A latest version without a score on the same
    metric and order (registered before versions were tagged with it, by hand, or with another
    checkpoint.score_attribute) cannot be compared: the model is registered, since refusing would
    leave the run unregistered over a number that does not exist, and the note says so."""
    latest = model_registry.latest_version(config)
    if latest is None:
        return True, ""  # the model's first version
    mine, theirs = score, latest.score
    if theirs is None or (theirs.attribute, theirs.order) != (mine.attribute, mine.order) or math.isnan(theirs.value):
        held = "no score" if theirs is None else f"{theirs.attribute} ({theirs.order}) {theirs.value:.6g}"
        return True, (
            f"registered: version {latest.version} has {held}, not comparable with {mine.attribute} ({mine.order}); "
            "mlflow.register=if_better registers what it cannot compare"
        )
    better = mine.value > theirs.value if mine.order == "max" else mine.value < theirs.value
    versus = f"{mine.attribute} {mine.value:.6g} is {'' if better else 'not '}better than version {latest.version}'s"
    if better:
        return True, f"{versus} {theirs.value:.6g}"
    return False, f"not registered: {versus} {theirs.value:.6g} (mlflow.register=if_better)"
