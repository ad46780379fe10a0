"""A sweep's search spaces: `train.lr=loguniform(1e-4, 1e-1)` and the like, parsed and checked
without Ray (the CLI refuses a bad space before anything starts).

    choice(a, b, ...)     one of the values, at random
    grid(a, b, ...)       every value: the trials cover each combination of the grids
    uniform(lo, hi)       a float, uniform in [lo, hi]
    loguniform(lo, hi)    a float, uniform in log space (0 < lo < hi): learning rates, weight decays
    randint(lo, hi)       an integer in [lo, hi) (Tune's convention: hi excluded)

A value in `choice`/`grid` is read as YAML reads it (`choice(32, 64)` gives integers, `choice(adamw, sgd)`
strings), as an override's value is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from raytrain_ddp.config.layering import read_value

KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
_SPACE = re.compile(r"^\s*(\w+)\s*\((.*)\)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Space:
    """One searched key's space: its kind and its values (the bounds, for a range)."""

    key: str
    kind: str
    values: tuple[Any, ...]

    @property
    def grid(self) -> bool:
        return self.kind == "grid"

    @property
    def log(self) -> bool:
        return self.kind == "loguniform"

    def examples(self) -> list[Any]:
        """Values the space can give, to check against the config: each listed value, a range's bounds."""
        if self.kind == "randint":
            return [self.values[0], self.values[1] - 1]
        return list(self.values)

    def text(self) -> str:
        return f"{self.kind}({', '.join(map(str, self.values))})"


def parse(key: str, text: Any) -> Space:
    """The space `text` (as written after `key=`); a ValueError naming the key says what is wrong."""
    match = _SPACE.match(str(text))
    if match is None or match.group(1) not in KINDS:
        raise ValueError(
            f"sweep.search.{key}={text!r}: not a search space; write one of "
            f"{', '.join(k + '(...)' for k in KINDS)}, e.g. {key}=loguniform(1e-4, 1e-1)"
        )
    kind, inside = match.group(1), match.group(2)
    values = tuple(read_value(f"[{inside}]") or [])
    if kind in ("choice", "grid"):
        if not values:
            raise ValueError(f"sweep.search.{key}={text}: {kind} needs at least one value")
        return Space(key, kind, values)
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"sweep.search.{key}={text}: {kind} takes two numbers, (low, high)")
    low, high = values
    if not low < high:
        raise ValueError(f"sweep.search.{key}={text}: the low bound must be below the high one")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"sweep.search.{key}={text}: loguniform needs a low bound above 0 (its log is taken)")
    if kind == "randint" and not all(float(v).is_integer() for v in values):
        raise ValueError(f"sweep.search.{key}={text}: randint takes whole numbers")
    if kind == "randint":
        low, high = int(low), int(high)
    return Space(key, kind, (low, high))


def grid_size(spaces: list[Space]) -> int:
    """How many combinations the grids make (1 without a grid)."""
    return math.prod(len(s.values) for s in spaces if s.grid)


def trials(spaces: list[Space], asked: int | None) -> tuple[int, list[str]]:
    """The number of trials (asked, or the grid's size where every space is a grid) and its problems:
    random spaces need a number, and a grid is covered whole, as often as the number allows."""
    size = grid_size(spaces)
    if asked is None:
        if all(s.grid for s in spaces):
            return size, []
        return 0, ["sweep.trials: how many trials to sample (--trials N) is not set"]
    if asked % size:
        return asked, [
            f"sweep.trials={asked}: the grids make {size} combinations, each tried as often as the others; "
            f"set sweep.trials to a multiple of {size}"
        ]
    return asked, []
