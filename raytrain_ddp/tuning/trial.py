"""What runs in a sweep's trial: Ray Tune's function trainable, in a Tune actor of its own. A trial is
a whole service run (`run`): its own run name (`<sweep>-t003`), checkpoints, exact resume, pre-flight
and MLflow run; each of its reports goes on to Tune, whose scheduler may stop the trial early.

Tune keeps no checkpoint of its own here: a restored sweep calls the trial again, and its run resumes
from the run's own checkpoints (or, finished, answers from its record and reports its last metrics).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray import tune
from rich.console import Console

from raytrain_ddp import ray_compat
from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.checkpoint import storage
from raytrain_ddp.config.layering import with_overrides, yaml_value
from raytrain_ddp.config.schema import Config, SweepSettings
from raytrain_ddp.driver.console import PLACEMENT_GROUP

# Where the sweep's driver notes that its scheduler stopped a trial: a trial restored without Tune's own
# record of that decision (the driver killed before Tune saved it) ends at once instead of training on.
STOPPED_FILE = "stopped_by_sweep.json"


def trial_config(base: Config, sampled: Mapping[str, Any], name: str, register: str = "never") -> Config:
    """A trial's run: the sweep's config with the sampled values, named `name`, with no sweep section of
    its own; `register`: its mlflow.register (the sweep registers the best trial's model itself)."""
    values = [f"{key}={yaml_value(value)}" for key, value in sampled.items()]
    config = with_overrides(base, *values, f"run.name={name}", f"mlflow.register={register}")
    return config.model_copy(update={"sweep": SweepSettings()})


def tune_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A report's numbers, as Tune takes them (no lists, strings or NaN-free guarantee needed)."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(float(value))
    }


@dataclass
class Reports:
    """Passes a run's reports on to Tune: those with the checkpoint score (the scheduler's metric), with
    the workers' placement group, which the sweep's driver removes if the scheduler stops the trial
    (Tune ends the trial's process, and the run's controller with it, before it can)."""

    score: str
    sent: int = 0

    def __call__(self, metrics: dict[str, Any]) -> None:
        if self.score not in metrics:
            return
        group = {PLACEMENT_GROUP: metrics[PLACEMENT_GROUP]} if PLACEMENT_GROUP in metrics else {}
        try:
            tune.report(tune_metrics(metrics) | group)
            self.sent += 1
        except BaseException:  # noqa: BLE001 - Tune stopping the trial (SystemExit) ends it; not the display's thread
            return


def train(sampled: dict[str, Any], *, base: dict[str, Any]) -> None:
    """Tune's trainable: the trial's run, trained (or resumed) to its end, its reports passed on."""
    from raytrain_ddp.driver.run import run  # the trial's process alone needs the driver's run

    # The trial's process carries Tune's runtime environment, which Ray merges into every actor it
    # starts: processes asked for ahead (prestart) would not match them, and would only load torch.
    os.environ[ray_compat.SWITCH_ENV] = ray_compat.switched_off("prestart")
    name = tune.get_context().get_trial_name()
    config = trial_config(Config.from_dict(base), sampled, name)
    stopped = stopped_at(config.run.path)
    if stopped is not None:
        tune.report(tune_metrics(stopped))
        return
    reports = Reports(config.checkpoint.score_attribute)
    summary = run(config, console=Console(soft_wrap=True, force_terminal=False), reported=reports)
    if reports.sent == 0:  # finished before: its record answered, so Tune has the run's last word
        tune.report(tune_metrics(summary.final_metrics))


def mark_stopped(run_path: str, metrics: Mapping[str, Any]) -> None:
    storage.write_text(f"{run_path}/{STOPPED_FILE}", json.dumps(tune_metrics(metrics)))


def trained_to_the_end(run_path: str, epochs: int) -> bool:
    """Whether a trial's run holds its last epoch's checkpoint, whole (its manifest is written last)."""
    return storage.read_text(f"{run_path}/{ckpt.dir_name(epochs, 0, 0)}/{ckpt.MANIFEST_FILE}") is not None


def clear_stopped(run_path: str) -> None:
    """Forget a stop that came as the trial's last epoch landed: its run finished."""
    fs, path = storage.locate(f"{run_path}/{STOPPED_FILE}")
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(path)


def stopped_at(run_path: str) -> dict[str, Any] | None:
    """The last metrics of a trial the sweep's scheduler stopped; None for one it did not."""
    text = storage.read_text(f"{run_path}/{STOPPED_FILE}")
    return None if text is None else json.loads(text)
