"""Early stopping: a run ends, finished, once its score has not improved for `patience` evaluations.

The score is the one that ranks checkpoints (checkpoint.score_attribute, score_order); an evaluation
is every report (each epoch's end, and every checkpoint.every_n_steps steps). An evaluation improves
on the best so far when it beats it by more than train.early_stopping.min_delta. Every rank takes the
same decision, from the same global score; the counter lives in each checkpoint's training state, so
a restarted or resumed run counts on where it stopped, and a run resumed with a larger patience (or
none) trains on. The run then registers its best checkpoint, as any finished run does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrain_ddp.config.schema import Config
from raytrain_ddp.worker.metrics import SINCE_BEST, STOPPED_EARLY


@dataclass
class EarlyStopping:
    """The patience counter of one rank (every rank's is the same): the best score so far and the
    evaluations since it. Kept whatever the patience, so that turning early stopping on when a run
    resumes counts from its real history."""

    patience: int | None  # None: never stops the run
    min_delta: float
    attribute: str
    order: str  # "max" or "min"
    best: float | None = None
    since_best: int = 0

    @classmethod
    def of(cls, config: Config, state: dict[str, Any] | None = None) -> EarlyStopping:
        """For `config`, counting on from a checkpoint's `state_dict()` (None or {}: a new run, or a
        checkpoint written before early stopping existed). A run resumed with another score (or
        order) counts afresh: a best of another metric means nothing to this one."""
        settings, c = config.train.early_stopping, config.checkpoint
        state = dict(state or {})
        if (state.pop("attribute", c.score_attribute), state.pop("order", c.score_order)) != (
            c.score_attribute,
            c.score_order,
        ):
            state = {}
        return cls(settings.patience, settings.min_delta, c.score_attribute, c.score_order, **state)

    def update(self, score: float) -> None:
        """Count one evaluation whose score is `score` (finite: loop._stop_reason stops a run before)."""
        if self.best is None or self._beats(score):
            self.best, self.since_best = score, 0
        else:
            self.since_best += 1

    def _beats(self, score: float) -> bool:
        return score > self.best + self.min_delta if self.order == "max" else score < self.best - self.min_delta

    @property
    def stops(self) -> bool:
        return stops(self.since_best, self.patience)

    def reason(self) -> str:
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        return (
            f"{self.attribute} has not improved{by} on its best, {self.best:.6g}, for {self.since_best} "
            f"evaluation{'s' * (self.since_best != 1)} (train.early_stopping.patience={self.patience})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "since_best": self.since_best, "attribute": self.attribute, "order": self.order}


def stops(since_best: int, patience: int | None) -> bool:
    return patience is not None and since_best >= patience


def ended_early(metrics: dict[str, Any], config: Config) -> str | None:
    """Why a run whose newest checkpoint was reported with `metrics` is done by `config`'s early
    stopping, if it is: its patience is spent (the run stopped there, or a resume lowered the
    patience). None: it trains on."""
    since_best, patience = int(metrics.get(SINCE_BEST, 0)), config.train.early_stopping.patience
    if not stops(since_best, patience):
        return None
    return metrics.get(STOPPED_EARLY) or (
        f"{config.checkpoint.score_attribute} has not improved for {since_best} evaluations "
        f"(train.early_stopping.patience={patience})"
    )
