"""`sweep(config) -> SweepSummary`: trials of a run with values drawn from its `sweep.search`, K at a
time, the trailing ones stopped early, the best trial's model registered.

    from raytrain_ddp import load_config, sweep
    summary = sweep(load_config("digits"), {"train.lr": "loguniform(1e-4, 1e-1)"}, trials=8, concurrent=2)

Ray Tune runs the trials: each is a function trainable (`trial.train`) whose run is a whole service run,
its reports passed on to Tune with `ray.tune.report` (the public API; Ray Train's own
`TuneReportCallback` is a developer API and would forward the controller's metrics, which the run's
driver already has). ASHA stops a trial that trails the others at the same epoch
(`checkpoint.score_attribute`). The sweep lives in `<run.storage_path>/<sweep name>` (Tune's record of
it), its trials in `<run.storage_path>/<sweep name>-t001` and on (their runs): the same command resumes
it, finished trials answered from their records, unfinished ones resumed from their checkpoints.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from ray import tune
from rich.console import Console
from rich.markup import escape

from raytrain_ddp.checkpoint import lease, storage
from raytrain_ddp.cluster import capacity, session
from raytrain_ddp.config import layering, search
from raytrain_ddp.config.layering import with_overrides, yaml_value
from raytrain_ddp.config.schema import Config, ConfigError, flatten
from raytrain_ddp.driver import plan as planning
from raytrain_ddp.driver.registration import register_finished
from raytrain_ddp.errors import RunInterrupted
from raytrain_ddp.preflight import checks as preflight
from raytrain_ddp.registry import records, tracking
from raytrain_ddp.tuning import trial as trials
from raytrain_ddp.tuning.table import Row, Trials, plot, ranked_rows, table

# A trial's own process only waits on its run's workers: it takes next to no CPU, so K trials of N
# workers need what K runs need (Tune's default, a whole CPU each, would not fit a small machine).
TRIAL_RESOURCES = {"cpu": 0.01}
# What Tune reads from the driver's environment (the user's setting wins):
TUNE_ENVIRONMENT = {
    # a trial's run reads its job and data where the sweep's command was given, not in Tune's trial folder
    "RAY_CHDIR_TO_TRIAL_DIR": "0",
    # a stopped trial's process ends within 10 s (Tune's 600 s would hold its CPU share that long)
    "TUNE_FORCE_TRIAL_CLEANUP_S": "10",
    # Tune's own console output (its experiment box, TensorBoard hint, status tables) off: the sweep's table says it
    "RAY_AIR_NEW_OUTPUT": "0",
}
NOT_SEARCHED = ("run.", "mlflow.", "sweep.", "job")  # where a run lives and is recorded: the sweep's, not a trial's


@dataclass(frozen=True)
class Sweep:
    """A sweep, decided before Ray starts: its resolved config and name, the spaces and the trials."""

    config: Config  # resolved: the sweep's name as run.name, absolute storage path, MLflow names
    spaces: list[search.Space]
    trials: int

    @property
    def name(self) -> str:
        return self.config.run.name

    @property
    def path(self) -> str:
        return self.config.run.path

    @property
    def resume_command(self) -> str:
        job_yaml = layering.job_config(self.config)
        base = planning.resolve(job_yaml, layering.origin_of(self.config).job.name)
        overrides = layering.overrides_against(self.config, base)
        overrides = [o for o in overrides if not o.startswith("run.name=")]
        return shlex.join(["raytrain-ddp", "sweep", self.config.job, f"run.name={self.name}", *overrides])


@dataclass(frozen=True)
class SweepSummary:
    name: str
    path: str  # <storage_path>/<sweep name>: Tune's record; the trials' runs beside it
    rows: list[Row]  # every trial, the best first
    best: Row | None
    model: records.RegisteredModel | None
    registration: str  # what registering the best trial's model decided, and why
    mlflow_run_id: str  # the sweep's parent run; each trial's run is nested under it
    plot: str | None  # scores.png: the score against each searched value
    resume_command: str
    wall_time_s: float
    spaces: list[search.Space] = field(default_factory=list)


def with_search(
    config: Config, space: dict[str, str] | None = None, trials: int | None = None, concurrent: int | None = None
) -> Config:
    """`config` with searched keys and the sweep's numbers set (`{"train.lr": "loguniform(1e-4, 1e-1)"}`)."""
    overrides = [f"sweep.search.{key}={value}" for key, value in (space or {}).items()]
    overrides += [f"sweep.trials={trials}"] if trials is not None else []
    overrides += [f"sweep.concurrent={concurrent}"] if concurrent is not None else []
    return with_overrides(config, *overrides) if overrides else config


def check(config: Config) -> Sweep:
    """The sweep of `config`, or a ConfigError naming every problem: a space that is no space, a key the
    run does not accept (with `train`'s "did you mean"), a value it refuses, a number of trials the grid
    cannot share, K trials that the machine can never hold. Reads the config alone: no Ray."""
    s, problems, spaces = config.sweep, [], []
    searched = {".".join(path): text for path, text in flatten(s.search).items()}
    if not searched:
        problems.append("sweep.search: nothing to search; give --search key=SPACE, e.g. train.lr=loguniform(1e-4,1e-1)")
    for key, text in searched.items():
        try:
            space = search.parse(key, text)
        except ValueError as e:
            problems.append(str(e))
            continue
        if key.startswith(NOT_SEARCHED):
            problems.append(
                f"sweep.search.{key}: {key} is the sweep's own, not a trial's: search a model, data or training key"
            )
            continue
        problems += _refused_values(config, space)
        spaces.append(space)
    count, wrong = search.trials(spaces, s.trials) if spaces else (0, [])
    problems += wrong
    if problems:
        raise ConfigError(config.job, problems)
    named = config if config.run.name else with_overrides(config, f"run.name={_new_name(config)}")
    resolved = planning.resolve(named, layering.origin_of(config).job.name)
    return Sweep(Config.from_dict(resolved.to_dict()), spaces, count)


def _refused_values(config: Config, space: search.Space) -> list[str]:
    """What the run refuses of the values `space` can give: an unknown key (did you mean), a bad value."""
    problems: list[str] = []
    for value in space.examples():
        try:
            with_overrides(config, f"{space.key}={yaml_value(value)}")
        except ConfigError as e:
            new = [f"sweep.search.{space.key}={space.text()}: {p}" for p in e.problems]
            problems += [p for p in new if p not in problems]
        except ValueError as e:  # the override itself (its key) malformed
            problems.append(f"sweep.search.{space.key}: {e}")
    return problems


def _new_name(config: Config) -> str:
    job = layering.origin_of(config).job.name
    return f"{job}-sweep-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def fits(config: Config, resources: dict[str, float], where: str) -> list[str]:
    """Whether `sweep.concurrent` trials of the run's size (an elastic run's least), each with its own
    process (TRIAL_RESOURCES), fit in `resources`."""
    k, s = config.sweep.concurrent, config.scaling
    problems = []
    for key, amount in capacity.per_worker(config).items():
        own = TRIAL_RESOURCES["cpu"] if key == "CPU" else 0.0
        need = k * (s.min_workers * amount + own)
        if need > resources.get(key, 0.0) + 1e-9:
            each = f"{s.min_workers} workers × {key} {amount:g}" + (f" + {own:g} for the trial" if own else "")
            problems.append(
                f"sweep.concurrent={k}: {k} trials × ({each}) need {key} {need:g}, "
                f"{where} has {resources.get(key, 0.0):g}; lower sweep.concurrent, scaling.num_workers or "
                "scaling.resources_per_worker"
            )
    return problems


def sweep(
    config: Config,
    space: dict[str, str] | None = None,
    *,
    trials: int | None = None,
    concurrent: int | None = None,
    verbose: bool = False,
    console: Console | None = None,
) -> SweepSummary:
    """Run the sweep of `config` (its `sweep:` section, with `space`, `trials` and `concurrent` over
    it) to its end, resuming it if it exists, and register the best trial's model as `mlflow.register`
    says. Raises ConfigError before Ray starts, RunInterrupted (with the resume command) if stopped."""
    started, console = time.monotonic(), console or Console(soft_wrap=True)
    plan = check(with_search(config, space, trials, concurrent))
    with session.bounded_mlflow_retries(), session.environment(_tune_environment()):
        address = preflight.check_before_ray(plan.config, plan.path)
        _check_settings(plan)
        if not address.join and (problems := fits(plan.config, {"CPU": float(os.cpu_count() or 1)}, "this machine")):
            raise ConfigError(plan.config.job, problems)
        session.quiet_logs(verbose)
        session.connect(address, verbose, lambda: None)
        import ray

        if problems := fits(plan.config, ray.cluster_resources(), "the cluster"):
            raise ConfigError(plan.config.job, problems)
        with lease.Lease(plan.path):
            _keep_settings(plan)
            parent = tracking.start_run(plan.config, plan.path)
            console.print(
                f"Sweep [bold]{plan.name}[/]: {plan.trials} trials of {escape(plan.config.job)}, "
                f"{plan.config.sweep.concurrent} at a time, each on {plan.config.scaling.workers_text}; "
                f"searching {', '.join(s.key + '=' + s.text() for s in plan.spaces)}"
            )
            rows = _run_trials(plan, console)
            return _conclude(plan, rows, parent, console, verbose, time.monotonic() - started)


SETTINGS_FILE = "sweep.json"  # what the sweep searches, as it started: a resume may not change it
SETTINGS = ("sweep.", "seed", "train.epochs", "checkpoint.score_")


def _check_settings(plan: Sweep) -> None:
    """A resumed sweep whose search changed is refused: Tune would go on with the trials it drew,
    whatever the command now says."""
    if (saved := storage.read_text(f"{plan.path}/{SETTINGS_FILE}")) is None:
        return
    was, now = json.loads(saved), _settings(plan)
    if changed := sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k)):
        started = ", ".join(f"{k}={yaml_value(was.get(k))}" for k in changed)
        raise ConfigError(
            plan.config.job,
            [f"sweep {plan.name} was started with {started}; resume it with those, or name another (run.name)"],
        )


def _keep_settings(plan: Sweep) -> None:
    path = f"{plan.path}/{SETTINGS_FILE}"
    if storage.read_text(path) is None:
        storage.write_text(path, json.dumps(_settings(plan), indent=1, sort_keys=True))


def _settings(plan: Sweep) -> dict[str, Any]:
    return {k: v for k, v in plan.config.flat().items() if k.startswith(SETTINGS)}


def _tune_environment() -> dict[str, str]:
    return {key: os.environ.get(key, value) for key, value in TUNE_ENVIRONMENT.items()}


def _run_trials(plan: Sweep, console: Console) -> list[Row]:
    """The trials, trained (or resumed) to their ends through Tune; raises RunInterrupted if stopped."""
    config, c = plan.config, plan.config.checkpoint
    trainable = tune.with_resources(tune.with_parameters(trials.train, base=config.to_dict()), TRIAL_RESOURCES)
    if tune.Tuner.can_restore(plan.path):
        console.print(f"Resuming the sweep from {plan.path}")
        tuner = tune.Tuner.restore(plan.path, trainable, resume_unfinished=True, resume_errored=True)
    else:  # Tune keeps the table with the sweep: a restored one shows it again (Trials.__setstate__)
        shown = Trials(plan.spaces, c.score_attribute, c.score_order, config.train.epochs, config.run.storage_path)
        shown.show_on(console)
        tuner = tune.Tuner(
            trainable,
            param_space={s.key: _tune_space(s) for s in plan.spaces},
            tune_config=_tune_config(plan),
            run_config=tune.RunConfig(
                name=plan.name, storage_path=config.run.storage_path, verbose=0, callbacks=[shown]
            ),
        )
    results = tuner.fit()
    rows = [_row(plan, result) for result in results]
    if unfinished := [r.name for r in rows if r.status in ("pending", "running", "unfinished")]:
        how = session.interrupted_by or "Ctrl-C"
        raise RunInterrupted(
            f"sweep {plan.name} was interrupted ({how}) with {len(unfinished)} trial(s) unfinished: "
            f"{', '.join(unfinished)}\nresume: {plan.resume_command}"
        )
    return ranked_rows(rows, config.checkpoint.score_order)


def _tune_config(plan: Sweep) -> tune.TuneConfig:
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    config, s = plan.config, plan.config.sweep
    return tune.TuneConfig(
        num_samples=plan.trials // search.grid_size(plan.spaces),
        # the same seed draws the same trials: a sweep is as reproducible as a run. (Tune's own
        # max_concurrent_trials does not limit a search algorithm given to it: this one limits itself.)
        search_alg=BasicVariantGenerator(random_state=config.seed, max_concurrent=s.concurrent),
        scheduler=ASHAScheduler(
            time_attr="epoch",
            metric=config.checkpoint.score_attribute,
            mode=config.checkpoint.score_order,
            # one past the last epoch: a trial that reaches it ends as a run ends (its workers' resources
            # freed by its controller), not stopped by the scheduler at its last report
            max_t=config.train.epochs + 1,
            grace_period=s.grace_epochs,
            reduction_factor=s.reduction_factor,
        ),
        trial_name_creator=functools.partial(trial_name, plan.name),
        trial_dirname_creator=functools.partial(trial_name, plan.name),
        reuse_actors=False,
    )


def trial_name(sweep_name: str, trial: Any) -> str:
    """`<sweep>-t003`: the third trial Tune made (its id ends in its index), as its run's name."""
    return f"{sweep_name}-t{int(trial.trial_id.rsplit('_', 1)[1]) + 1:03d}"


def _tune_space(space: search.Space) -> Any:
    values = list(space.values)
    return {
        "choice": lambda: tune.choice(values),
        "grid": lambda: tune.grid_search(values),
        "uniform": lambda: tune.uniform(*values),
        "loguniform": lambda: tune.loguniform(*values),
        "randint": lambda: tune.randint(*values),
    }[space.kind]()


def _row(plan: Sweep, result: Any) -> Row:
    """A trial as its run's record and Tune's result have it: its best score, from its checkpoints (as
    registration ranks them), and its status, from its last report (and whether the scheduler stopped it)."""
    name = os.path.basename(result.path.rstrip("/"))
    config = plan.config
    score, epochs = config.checkpoint.score_attribute, config.train.epochs
    trial = trials.trial_config(config, dict(result.config), name)
    standing = planning.resume_point(trial.run.path, trial)
    best = (standing.best or {}).get(score)
    # Tune's last result, or further where the run's epochs outran Tune's reading of its reports
    epoch = max(float((result.metrics or {}).get("epoch", 0)), standing.epoch)
    if result.error is not None:
        status = "failed"
    elif epoch >= epochs:  # a stop that reached it only as its last epoch landed is forgotten
        status = "finished"
        trials.clear_stopped(trial.run.path)
    elif trials.stopped_at(trial.run.path) is not None:
        status = "stopped"
    else:
        status = "unfinished"
    return Row(name, dict(result.config), status, epoch, best)


def _conclude(
    plan: Sweep, rows: list[Row], parent: str, console: Console, verbose: bool, wall_s: float
) -> SweepSummary:
    """Each trial's MLflow run nested under the sweep's, the plot, the best trial's model registered."""
    config = plan.config
    for row in rows:
        trial = trials.trial_config(config, row.values, row.name)
        if (run_id := tracking.find_run(trial, trial.run.path)) is not None:
            tracking.nest(trial, run_id, parent, {"sweep": plan.name, "sweep.status": row.status})
    picture = f"{plan.path}/scores.png"
    try:
        plot(rows, plan.spaces, config.checkpoint.score_attribute, picture)
        tracking.log_file(config, parent, picture)
    except Exception as e:  # noqa: BLE001 - a figure: never a reason to fail a sweep that trained
        console.print(f"[yellow]plot not drawn[/]: {escape(str(e))}")
        picture = None
    best = next((r for r in rows if r.score is not None and r.status in ("finished", "stopped")), None)
    model, note = None, "no trial reported a score"
    if best is not None:
        policy = config.mlflow.register
        chosen = trials.trial_config(config, best.values, best.name, register=policy)
        registration, _ = register_finished(chosen, policy, verbose=verbose, console=console)
        model, note = registration.model, registration.note
        tracking.log_best(config, parent, config.checkpoint.score_attribute, best.score, best.name)
    tracking.finish_run(config, parent, "FINISHED")
    summary = SweepSummary(
        plan.name, plan.path, rows, best, model, note, parent, picture, plan.resume_command, wall_s, plan.spaces
    )
    show(console, summary, config)
    return summary


def show(console: Console, summary: SweepSummary, config: Config) -> None:
    c = config.checkpoint
    keys = [s.key for s in summary.spaces]
    console.print(table(summary.rows, keys, c.score_attribute, c.score_order))
    counts = {s: sum(r.status == s for r in summary.rows) for s in ("finished", "stopped", "failed")}
    done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    console.print(f"[bold]Sweep {summary.name}[/]: {len(summary.rows)} trials ({done}) in {summary.wall_time_s:.0f} s")
    if summary.best is not None:
        values = ", ".join(f"{k}={yaml_value(v)}" for k, v in summary.best.values.items())
        console.print(f"best: {summary.best.name} ({values}): {c.score_attribute} {summary.best.score:.4g}")
    if summary.model is not None:
        m, note = summary.model, f" ({summary.registration})" if summary.registration else ""
        console.print(f"registered: {m.name} version {m.version} ({m.uri}){escape(note)}")
    else:
        console.print(f"not registered: {escape(summary.registration)}")
    if summary.plot:
        console.print(f"plot: {summary.plot}")
    console.print(
        f"MLflow run {summary.mlflow_run_id} (each trial's run nested under it) in {config.mlflow.tracking_uri}"
    )
