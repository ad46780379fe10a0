"""The registry's `champion` alias: which version of a model it points at, decided from the registry's
state alone (each version's score tags, and the last promotion by hand), so that every process that
changes that state can set the alias and converge on one answer (`model_registry.converge_champion` says why
two runs registering at once still leave one champion).

The rule, as one run after another would apply it: a new version becomes champion only if its score
beats the champion's on the same metric and order (strictly; NaN never does; without a champion yet,
it does); `raytrain-ddp promote <name> <version>` makes a version champion by hand, and the versions
registered after that compete with it. In version order from the last promotion (else from the first
version), that is a running best:

    v1 0.90 champion   v2 0.85 not better   v3 0.93 champion   promote v2   v4 0.91 beats v2: champion

(`latest` needs no rule: MLflow reserves it and resolves `models:/<name>@latest` to the newest version.)
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain_ddp.registry.records import RegisteredModel, Score


@dataclass(frozen=True)
class Promotion:
    """`raytrain-ddp promote`'s record, a tag of the registered model: the version made champion by
    hand, and the newest version then (only later ones compete with it)."""

    version: int
    newest: int

    def tag(self) -> str:
        return json.dumps({"version": self.version, "newest": self.newest})

    @classmethod
    def from_tag(cls, value: str | None) -> Promotion | None:
        """The promotion a tag records; None for no tag, or one that is not a promotion (edited by hand)."""
        try:
            found = json.loads(value) if value else None
            return cls(int(found["version"]), int(found["newest"]))
        except (ValueError, TypeError, KeyError):
            return None


def champion(versions: Sequence[RegisteredModel], promotion: Promotion | None) -> RegisteredModel | None:
    """The version the rule makes champion: from the promoted version (a promotion of a version that
    no longer exists is ignored), each later version in number order takes over if it beats the one
    before it. None: no version, or none that could be (all NaN)."""
    current, contenders = _start(versions, promotion)
    for version in contenders:
        if beats(version, current):
            current = version
    return current


def _start(
    versions: Sequence[RegisteredModel], promotion: Promotion | None
) -> tuple[RegisteredModel | None, list[RegisteredModel]]:
    ordered = sorted(versions, key=lambda v: v.version)
    promoted = next((v for v in ordered if promotion is not None and v.version == promotion.version), None)
    if promoted is None:
        return None, ordered
    return promoted, [v for v in ordered if v.version > promotion.newest]


def beats(version: RegisteredModel, current: RegisteredModel | None) -> bool:
    """Whether `version` takes the champion's place from `current`."""
    mine = version.score
    if mine is not None and math.isnan(mine.value):
        return False
    if current is None:
        return True
    theirs = current.score
    if not comparable(mine, theirs):
        return False
    return mine.value > theirs.value if mine.order == "max" else mine.value < theirs.value


def comparable(mine: Score | None, theirs: Score | None) -> bool:
    """Scores on the same metric and order, so that one can beat the other."""
    return mine is not None and theirs is not None and (mine.attribute, mine.order) == (theirs.attribute, theirs.order)


def verdict(versions: Sequence[RegisteredModel], promotion: Promotion | None, new: RegisteredModel) -> str:
    """How `new` fared against the champion just before it (the rule applied to the versions before
    it), in a line: written on the version when it is registered. The same registry gives the same
    line, whichever process writes it."""
    before = champion([v for v in versions if v.version < new.version], promotion)
    mine = new.score
    if not beats(new, before):
        if before is None or comparable(mine, before.score):  # NaN, or not better
            versus = "" if before is None else f" than version {before.version}'s {before.score.value:.6g}"
            return f"not champion: {mine.attribute} {mine.value:.6g} is not better{versus}"
        promote = shlex.join(["raytrain-ddp", "promote", new.name, str(new.version)])
        return (
            f"not champion: {_described(mine)} is not comparable with version {before.version}'s "
            f"{_described(before.score)}; make it champion by hand: {promote}"
        )
    if before is None:
        return "champion: no version was champion before it"
    return f"champion: {mine.attribute} {mine.value:.6g} beats version {before.version}'s {before.score.value:.6g}"


def _described(score: Score | None) -> str:
    return "no score" if score is None else f"{score.attribute} ({score.order}) {score.value:.6g}"
