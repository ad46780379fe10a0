"""Early stopping's rule, checked directly: patience counted in evaluations, min_delta, both score
orders, the counter carried through a checkpoint's state, and when a saved run counts as ended."""

from __future__ import annotations

import pytest

from raytrain_ddp.config.layering import load_config
from raytrain_ddp.config.schema import Config, ConfigError
from raytrain_ddp.worker.early_stopping import EarlyStopping, ended_early


def _config(**early) -> Config:
    settings = {"patience": 2, **early}
    return Config(job="digits", train={"early_stopping": settings})


def _feed(stopping: EarlyStopping, scores: list[float]) -> list[bool]:
    said = []
    for score in scores:
        stopping.update(score)
        said.append(stopping.stops)
    return said


def test_patience_counts_evaluations_without_improvement_and_an_improvement_resets_it():
    stopping = EarlyStopping.of(_config())  # val_loss, min
    assert _feed(stopping, [1.0, 0.9, 0.95, 0.8, 0.85, 0.81]) == [False, False, False, False, False, True]
    assert (stopping.best, stopping.since_best) == (0.8, 2)
    assert "val_loss has not improved on its best, 0.8, for 2 evaluations (train.early_stopping.patience=2)" == (
        stopping.reason()
    )


def test_an_equal_score_or_one_better_by_min_delta_or_less_is_no_improvement():
    stopping = EarlyStopping.of(_config(min_delta=0.1))
    assert _feed(stopping, [1.0, 1.0, 0.9]) == [False, False, True]  # 0.9 is better by 0.1: not more
    assert "by more than 0.1" in stopping.reason()
    stopping = EarlyStopping.of(_config(min_delta=0.1))
    assert _feed(stopping, [1.0, 1.0, 0.89, 0.85]) == [False, False, False, False]


def test_a_score_to_maximize_improves_upwards():
    config = Config(
        job="digits",
        train={"early_stopping": {"patience": 1}},
        checkpoint={"score_attribute": "val_accuracy", "score_order": "max"},
    )
    stopping = EarlyStopping.of(config)
    assert _feed(stopping, [0.5, 0.7, 0.6]) == [False, False, True]
    assert stopping.best == 0.7 and "val_accuracy" in stopping.reason()


def test_without_patience_the_counter_runs_but_never_stops():
    stopping = EarlyStopping.of(Config(job="digits"))
    assert _feed(stopping, [1.0] * 20) == [False] * 20
    assert stopping.since_best == 19


def test_the_counter_carries_over_a_checkpoints_state_and_a_new_patience_applies_to_it():
    stopping = EarlyStopping.of(_config(patience=5))
    _feed(stopping, [1.0, 1.1, 1.2])
    resumed = EarlyStopping.of(_config(patience=3), stopping.state_dict())
    assert (resumed.best, resumed.since_best, resumed.patience) == (1.0, 2, 3)
    assert _feed(resumed, [1.3]) == [True]
    assert EarlyStopping.of(_config(), {}).best is None  # a checkpoint from before early stopping existed


def test_a_saved_run_has_ended_when_its_patience_is_spent_under_the_config_it_resumes_with():
    said = {"epoch": 3.0, "evals_since_best": 2, "stopped_early": "val_loss has not improved ..."}
    assert ended_early(said, _config(patience=2)) == said["stopped_early"]
    assert ended_early(said, _config(patience=3)) is None  # a larger patience trains on
    assert ended_early(said, Config(job="digits")) is None
    lowered = ended_early({"epoch": 3.0, "evals_since_best": 2}, _config(patience=1))
    assert lowered == "val_loss has not improved for 2 evaluations (train.early_stopping.patience=1)"
    assert ended_early({"epoch": 3.0}, _config()) is None  # a checkpoint from before early stopping existed


def test_patience_and_min_delta_are_validated_with_their_keys():
    with pytest.raises(ConfigError) as refused:
        load_config("digits", overrides=["train.early_stopping.patience=0", "train.early_stopping.min_delta=-1"])
    text = str(refused.value)
    assert "train.early_stopping.patience" in text and "train.early_stopping.min_delta" in text
