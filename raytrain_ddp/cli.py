"""The command line.

raytrain-ddp train digits                              # the flagship job on a local Ray
raytrain-ddp train digits train.epochs=3 run.name=x    # key.sub=value overrides
raytrain-ddp train digits --print-config               # validate and show the resolved config
raytrain-ddp sweep digits --search 'train.lr=loguniform(1e-4,1e-1)' --trials 8  # trials, the best registered
raytrain-ddp jobs                                      # the jobs it can find
raytrain-ddp register runs/<name>                      # register a finished run's model (whatever mlflow.register said)
raytrain-ddp promote <model> <version>                 # make a registered version the champion by hand
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import signal
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel

from raytrain_ddp.cluster import ray_address
from raytrain_ddp.config import layering, signatures
from raytrain_ddp.config import recipe as recipes
from raytrain_ddp.config.layering import load_config
from raytrain_ddp.config.schema import Config, ConfigError

OVERRIDES_HELP = """\
overrides:
  key.sub=value pairs, applied last (schema defaults < job YAML < --config FILE < overrides).
  Values are YAML: train.lr=3e-4, scaling.use_gpu=true, run.name=null, 'scaling.resources_per_worker={CPU: 2}'.
  model.* and dataset.* are the keyword arguments of the recipe's build_model / build_datasets.
  Unknown keys, wrong types and impossible values are all reported at once, before Ray starts.
  Running again with the same run.name (and run.storage_path) resumes that run where its newest valid
  checkpoint left off; a run another live driver is training is refused; a finished one says so at once
  (train it longer with train.epochs=N). RAY_ADDRESS names the cluster to join (host:port of its GCS,
  or auto); unset, a local Ray is started.

keys (default: meaning):
"""


def entry() -> None:
    """The `raytrain-ddp` command: `main`, then the exit handlers (Ray's, MLflow's, logging's), then out
    without the interpreter's teardown, which frees torch, MLflow and Ray module by module: seconds of
    a command whose work is done."""
    try:
        code = main()
    except KeyboardInterrupt:  # where the command has nothing more to say (a recipe importing torch, say)
        print("interrupted (Ctrl-C)", file=sys.stderr)
        code = 130
    atexit._run_exitfuncs()  # what sys.exit would run first; os._exit skips only the teardown after it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # Overrides may also follow an option (`train JOB --config F k=v`), where argparse stops taking them.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in ("train", "sweep") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "jobs":
        searched = ", ".join(map(str, recipes.job_search_path()))
        print("\n".join(recipes.available_jobs()) or f"no jobs found in: {searched}")
        return 0
    if args.command == "promote":
        return _promote(args)
    if args.command == "sweep":
        return _sweep(args)
    return _register(args) if args.command == "register" else _train(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-ddp", description="Distributed data-parallel PyTorch on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a job (resumes when run.name names an existing run)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=OVERRIDES_HELP + "\n".join(_describe_keys(Config)),
    )
    train.add_argument("job", help="a job name from jobs/ (see `raytrain-ddp jobs`) or a path to a job's .py/.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
    train.add_argument("--config", metavar="FILE", help="a YAML layered over the job's own YAML")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--verbose", action="store_true", help="also show Ray's own logs")
    _sweep_parser(commands)
    commands.add_parser("jobs", help="list the jobs found in ./jobs and the project's jobs/")
    register = commands.add_parser(
        "register",
        help="register the model of a run that finished training but was not registered",
        description="Register the best checkpoint of a finished run that was not registered: its driver could not "
        "(the MLflow tracking server was down, say), or its mlflow.register (if_better, never) said no. It registers "
        "whatever that setting says. Registering twice creates no second version.",
    )
    register.add_argument(
        "run", help="the run's directory: <run.storage_path>/<run.name> (a path or URI, e.g. s3://bucket/runs/name)"
    )
    register.add_argument("--tracking-uri", help="the MLflow tracking server (default: the one the run used)")
    register.add_argument("--verbose", action="store_true", help="also show Ray's own logs")
    promote = commands.add_parser(
        "promote",
        help="point a registered model's champion alias at a version, by hand",
        description="Make a version of a registered model its champion (models:/<model>@champion) by hand: a worse "
        "version, say, or one scored on another metric. Versions registered later compete with it: the first to beat "
        "its score on the same metric takes the alias.",
    )
    promote.add_argument("model", help="the registered model's name (mlflow.model_name)")
    promote.add_argument("version", type=int, help="the version to make champion")
    promote.add_argument(
        "--tracking-uri", help="the MLflow tracking server (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
    )
    return parser


def _sweep_parser(commands: typing.Any) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="search hyper-parameters: trials of a job (Ray Tune), the trailing ones stopped early, the best kept",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train trials of the job, each a whole run (`<sweep>-t001`, ...) with values drawn from the "
        "searched spaces, K at a time; stop those that trail the others at the same epoch (ASHA, on "
        "checkpoint.score_attribute); register the best trial's model as mlflow.register says. The same command "
        "(with the run.name it prints) resumes a sweep: finished trials are not trained again.",
        epilog="spaces: choice(a,b,...) grid(a,b,...) uniform(lo,hi) loguniform(lo,hi) randint(lo,hi) (hi excluded)\n"
        "the sweep's settings: sweep.* (see `raytrain-ddp train --help`); a job's YAML may hold a sweep: section",
    )
    sweep.add_argument("job", help="a job name from jobs/ or a path to a job's .py/.yaml")
    sweep.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for train")
    sweep.add_argument(
        "--search",
        action="append",
        default=[],
        metavar="KEY=SPACE",
        help="a key to search, e.g. train.lr=loguniform(1e-4,1e-1)",
    )
    sweep.add_argument("--trials", type=int, metavar="N", help="how many trials (default: the grid's combinations)")
    sweep.add_argument("--concurrent", type=int, metavar="K", help="trials trained at once (default 1)")
    sweep.add_argument("--config", metavar="FILE", help="a YAML layered over the job's own YAML")
    sweep.add_argument("--verbose", action="store_true", help="also show Ray's and Tune's own logs")


def _sweep(args: argparse.Namespace) -> int:
    wrong = [s for s in args.search if "=" not in s]
    searched = [f"sweep.search.{s}" for s in args.search]
    numbers = [f"sweep.trials={args.trials}"] * (args.trials is not None)
    numbers += [f"sweep.concurrent={args.concurrent}"] * (args.concurrent is not None)
    try:
        if wrong:
            raise ConfigError(
                args.job, [f"--search {s}: expected KEY=SPACE, e.g. train.lr=loguniform(1e-4,1e-1)" for s in wrong]
            )
        config = load_config(args.job, config_file=args.config, overrides=[*args.overrides, *searched, *numbers])
        address = ray_address.check_environment()
        if address.problem:
            raise ConfigError(config.job, [address.problem])
        from raytrain_ddp.tuning import driver

        driver.check(config)  # every problem of the spaces, before torch's and Ray's imports pay off
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from raytrain_ddp.cluster import session

    session.stop_on_sigterm()
    try:
        return _exit_status(driver.sweep, config, args.verbose, session)
    finally:
        _leave_ray()


def _train(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.job, config_file=args.config, overrides=args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        return _print_config(config)
    address = ray_address.check_environment()
    if address.problem:  # in a second, before torch and Ray load
        print(f"error: {ConfigError(config.job, [address.problem])}", file=sys.stderr)
        return 2

    from raytrain_ddp.driver.timeline import Timeline

    clock = Timeline()  # the run's phases, timed from this process's launch
    clock.mark("config")
    from raytrain_ddp.cluster import prestart, session

    if _new_run(config):  # Ray starts (or is joined), and the run's processes, while torch and Ray Train load
        session.start(address, args.verbose, functools.partial(prestart.ahead, config))
    elif (busy := _held_by_another_driver(config)) is not None:  # in a second, before torch and Ray load
        print(f"error: {busy}", file=sys.stderr)
        return 2
    run = _import_the_run(session)
    if run is None:
        print("interrupted (Ctrl-C) while loading, before anything was read or written", file=sys.stderr)
        return 130
    clock.mark("imports")
    session.stop_on_sigterm()
    try:
        return _exit_status(functools.partial(run, timeline=clock), config, args.verbose, session)
    finally:
        _leave_ray()


def _print_config(config: Config) -> int:
    """The resolved config; where the recipe derives settings from its data, with them (its data read,
    the recipe imported: seconds, not a fifth of one)."""
    if signatures.defines(layering.origin_of(config).job.files.recipe, "derive_settings"):
        from raytrain_ddp.driver.plan import from_the_data

        try:
            config, _ = from_the_data(config)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0


def _import_the_run(session: typing.Any) -> typing.Any:
    """`driver.run.run`, imported (torch and Ray, only to train; MLflow comes while Ray starts); None
    where Ctrl-C was pressed meanwhile. Ctrl-C while loading is noted, and acted on once the imports end
    (a few seconds): raised inside them, it can land in the import machinery's callback of a lock,
    where Python prints it and drops it, and the command would go on to train."""
    pressed: list[int] = []

    def note(signum: int, _frame: object) -> None:
        pressed.append(signum)

    handler = signal.signal(signal.SIGINT, note)
    try:
        from raytrain_ddp.driver.run import run

        if pressed:
            raise KeyboardInterrupt
        return run
    except KeyboardInterrupt:
        session.leave()
        return None
    finally:
        if signal.getsignal(signal.SIGINT) is note:  # not one an import installed meanwhile
            signal.signal(signal.SIGINT, handler)


def _exit_status(run: typing.Any, config: Config, verbose: bool, session: typing.Any) -> int:
    """Train, and the command's exit status: 0 done, 1 failed, 2 refused, 3 not registered, 130/143
    interrupted (Ctrl-C / SIGTERM)."""
    from raytrain_ddp.checkpoint.lease import RunBusy
    from raytrain_ddp.errors import RegistrationFailed, RunFailed, RunInterrupted

    try:
        run(config, verbose=verbose)
    except (ConfigError, RunBusy) as e:  # what only the recipe, the cluster, the servers or the run's record could tell
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunInterrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return 143 if session.interrupted_by == "SIGTERM" else 130
    except KeyboardInterrupt:  # before training began, or after it ended: nothing to resume from there
        how = session.interrupted_by or "Ctrl-C"
        print(f"interrupted ({how}) before training began or after it ended: the same command resumes", file=sys.stderr)
        return 143 if session.interrupted_by == "SIGTERM" else 130
    except RegistrationFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _new_run(config: Config) -> bool:
    """Whether `config` starts a new run (a run found on storage may have finished: answered from its
    record, without Ray). A run on remote storage is looked for later, with Ray."""
    from raytrain_ddp.checkpoint import storage

    name, path = config.run.name, config.run.storage_path
    return name is None or not storage.is_uri(path) and not Path(_run_path(config)).exists()


def _run_path(config: Config) -> str:
    """The named run's directory: an absolute local path, or a URI (s3://bucket/prefix/name)."""
    from raytrain_ddp.checkpoint import storage

    return storage.absolute(config.run.path)


def _held_by_another_driver(config: Config) -> str | None:
    """Why a run found on storage cannot be trained now: a live driver holds it (the run's own check,
    under the lease it takes, says the same later)."""
    from raytrain_ddp.checkpoint import lease
    from raytrain_ddp.checkpoint.lease import RunBusy

    try:
        lease.check(_run_path(config))
    except RunBusy as e:
        return str(e)
    return None


def _leave_ray() -> None:
    """Leave Ray (and stop the local one this command started) now, rather than in the interpreter's
    exit: with torch and MLflow loaded, Ray's exit hook and the interpreter's teardown take a second
    longer."""
    from raytrain_ddp.cluster import session

    session.leave()


def _register(args: argparse.Namespace) -> int:
    from raytrain_ddp.checkpoint.format import NoValidCheckpoint
    from raytrain_ddp.checkpoint.lease import RunBusy
    from raytrain_ddp.driver.registration import register
    from raytrain_ddp.errors import RunFailed

    try:
        register(args.run, tracking_uri=args.tracking_uri, verbose=args.verbose)
    except (ConfigError, RunBusy, NoValidCheckpoint) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:  # registering failed mid-way: the message says how to finish it
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the tracking server failing before it began, say: run it again
        print(f"error: the model was not registered: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _promote(args: argparse.Namespace) -> int:
    from raytrain_ddp.registry import endpoint, model_registry

    uri = endpoint.resolve_tracking_uri(args.tracking_uri)
    if (unreachable := endpoint.check_server(uri)) is not None:
        print(f"error: {unreachable}", file=sys.stderr)
        return 2
    try:
        was, now = model_registry.promote(uri, args.model, args.version)
    except LookupError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    before = "no version" if was is None else f"version {was}"
    if now != args.version:  # another writer's newer version beat it meanwhile
        print(f"{args.model}: promoted version {args.version}, but version {now} beat it since: champion is {now}")
    elif was == now:
        print(f"{args.model}: champion stays version {now} (promoted by hand: later versions compete with it)")
    else:
        print(f"{args.model}: champion moved from {before} to version {now}")
    return 0


def _describe_keys(schema: type[BaseModel], prefix: str = "") -> list[str]:
    lines = []
    for name, field in schema.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += _describe_keys(annotation, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        allowed = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
        shown = (
            "|".join(allowed)
            if allowed
            else (
                "required"
                if field.is_required()
                else yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n...")
            )
        )
        lines.append(f"  {prefix}{name} ({shown}): {field.description or ''}")
    return lines


if __name__ == "__main__":
    entry()
