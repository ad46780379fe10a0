"""A sweep's search spaces, read as the command line and a `sweep:` section write them (no Ray)."""

from __future__ import annotations

import pytest

from raytrain_ddp.config import search


@pytest.mark.parametrize(
    ("text", "kind", "values", "examples"),
    [
        ("loguniform(1e-4, 1e-1)", "loguniform", (1e-4, 0.1), [1e-4, 0.1]),
        ("uniform(0, 0.5)", "uniform", (0, 0.5), [0, 0.5]),
        ("randint(2, 9)", "randint", (2, 9), [2, 8]),  # hi excluded, as Tune's
        ("choice(adamw, sgd)", "choice", ("adamw", "sgd"), ["adamw", "sgd"]),
        ("grid(32, 64)", "grid", (32, 64), [32, 64]),
        (" grid( 1e-3 ,0.1 ) ", "grid", (1e-3, 0.1), [1e-3, 0.1]),
    ],
)
def test_each_space_reads_its_values_as_yaml_reads_an_override(text, kind, values, examples):
    space = search.parse("train.lr", text)
    assert (space.kind, space.values, space.examples()) == (kind, values, examples)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("1e-3", "not a search space"),
        ("normal(0, 1)", "not a search space"),
        ("choice()", "choice needs at least one value"),
        ("uniform(1)", "takes two numbers"),
        ("uniform(a, b)", "takes two numbers"),
        ("uniform(2, 1)", "the low bound must be below the high one"),
        ("loguniform(0, 1)", "loguniform needs a low bound above 0"),
        ("randint(0.5, 3)", "randint takes whole numbers"),
    ],
)
def test_a_bad_space_names_its_key_and_what_is_wrong(text, said):
    with pytest.raises(ValueError, match=said) as refused:
        search.parse("train.lr", text)
    assert str(refused.value).startswith("sweep.search.train.lr=")


def test_trials_cover_the_grid_whole_and_random_spaces_need_a_number():
    grids = [search.parse("a", "grid(1, 2)"), search.parse("b", "grid(x, y, z)")]
    randomly = [*grids, search.parse("c", "uniform(0, 1)")]
    assert search.grid_size(grids) == 6
    assert search.trials(grids, None) == (6, [])  # every combination once
    assert search.trials(randomly, 12) == (12, [])  # each combination twice, with its own draws
    assert search.trials(randomly, 7)[1] == [
        "sweep.trials=7: the grids make 6 combinations, each tried as often as the others; "
        "set sweep.trials to a multiple of 6"
    ]
    assert "how many trials" in search.trials(randomly, None)[1][0]
