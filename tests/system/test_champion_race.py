"""Two processes registering versions of one model at once, against a real `mlflow server`, through
`model_registry.register_model` as a run does (no Ray): after every round the `champion` alias is where the
rule says for the versions the registry ended up with, whichever got the lower number, and `latest`
is the newest.

Each round both processes log their model and wait for each other; then both create their version at
the same moment (the registered model, the version numbers and the alias's first insert are
contested), or B creates its version a moment later, while A, whose reads of the registry reach it
late (a slow network, simulated), still holds a read without it: the alias A then writes is stale,
and only reading again after writing puts it right (without that, a staggered round ends with A's
stale choice: checked). About 30 s."""

from __future__ import annotations

import multiprocessing
import time
from functools import partial
from pathlib import Path

import pytest
from services import MLflowServer

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")
MODEL = "contested"
BEST = "val_accuracy", "max"
SLOW_READ_S = 0.4  # how late A's reads of the registry reach it
LATER_S = 0.2  # how much later B creates its version in a staggered round
# Each round: the score each process registers, whether B creates its version later, and which of the
# round's versions is champion then: its process's, "first" (the lower number), or None (it stays).
ROUNDS = [
    ({"A": 0.80, "B": 0.90}, True, "B"),
    ({"A": 0.95, "B": 0.85}, False, "A"),
    ({"A": 0.97, "B": 0.97}, False, "first"),  # a tie: the later of the two does not beat the earlier
    ({"A": 0.50, "B": 0.60}, False, None),  # both worse
    # before this round, A's 0.50 is promoted by hand: both beat it, B by more
    ({"A": 0.55, "B": 0.70}, True, "B"),
    ({"A": ("val_loss", "min", 0.10), "B": 0.65}, False, None),  # A's metric is another, B's is no better
]
PROMOTED_BEFORE_ROUND = 4  # A's version of round 3 (counting from 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


def test_two_runs_registering_at_once_leave_one_consistent_champion(server):
    from raytrain_ddp.registry import model_registry, records

    client = server.client()
    client.create_experiment("race")
    spawn = multiprocessing.get_context("spawn")
    start, done, created = spawn.Barrier(3), spawn.Barrier(3), spawn.Barrier(2)
    workers = [
        spawn.Process(target=_register_rounds, args=(server.url, who, start, done, created), name=who)
        for who in ("A", "B")
    ]
    for worker in workers:
        worker.start()
    try:
        champion = None
        for number, (_, _, expected) in enumerate(ROUNDS):
            if number == PROMOTED_BEFORE_ROUND:
                champion = _version_of(client, f"A-{number - 1}")
                model_registry.promote(server.url, MODEL, champion)
            start.wait(timeout=120)
            done.wait(timeout=120)
            mine = {who: _version_of(client, f"{who}-{number}") for who in ("A", "B")}
            if expected is not None:
                champion = min(mine.values()) if expected == "first" else mine[expected]
            registry = f"round {number}: {_registry(client)}"
            assert _alias(client, "champion") == champion, registry
            assert _alias(client, "latest") == 2 * (number + 1), registry
            said = client.get_model_version(MODEL, str(champion)).tags.get(records.CHAMPION_TAG, "")
            assert said.startswith("champion:") or number >= PROMOTED_BEFORE_ROUND and expected is None, registry
    finally:
        for barrier in (start, done, created):
            barrier.abort()
        for worker in workers:
            worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0]


def _version_of(client, checkpoint: str) -> int:
    from raytrain_ddp.registry.records import CHECKPOINT_TAG

    [version] = [v for v in client.search_model_versions(f"name = '{MODEL}'") if v.tags[CHECKPOINT_TAG] == checkpoint]
    return int(version.version)


def _alias(client, alias: str) -> int:
    return int(client.get_model_version_by_alias(MODEL, alias).version)


def _registry(client) -> str:
    """Each version's checkpoint, score and how it fared; the aliases."""
    from raytrain_ddp.registry.records import CHAMPION_TAG, CHECKPOINT_TAG, SCORE_TAG

    versions = sorted(client.search_model_versions(f"name = '{MODEL}'"), key=lambda v: int(v.version))
    said = [f"v{v.version} {v.tags[CHECKPOINT_TAG]} {v.tags[SCORE_TAG]}: {v.tags.get(CHAMPION_TAG)}" for v in versions]
    return "; ".join(said) + f"; aliases {client.get_registered_model(MODEL).aliases}"


def _register_rounds(uri: str, who: str, start, done, created) -> None:
    """One process's registrations: a round at a time, when the test says (`start`), creating its
    version when the other process does (`created`), or, B in a staggered round, a moment later."""
    import numpy as np
    import torch

    from raytrain_ddp import load_config
    from raytrain_ddp.registry import model_registry, records, tracking

    overrides = [
        f"mlflow.tracking_uri={uri}",
        "mlflow.experiment=race",
        f"mlflow.model_name={MODEL}",
        f"run.name={who}",
    ]
    config = load_config(TINY, overrides=overrides)
    run_id = tracking.start_run(config, f"/runs/{who}")
    model, example = torch.nn.Linear(4, 1), np.zeros((2, 4), np.float32)
    if who == "A":
        read_registry = model_registry.read_registry

        def read_late(client, name):
            found = read_registry(client, name)
            time.sleep(SLOW_READ_S)
            return found

        model_registry.read_registry = read_late

    try:
        for number, (scores, staggered, _) in enumerate(ROUNDS):
            log = partial(_log_then_wait, model, example, created, LATER_S if staggered and who == "B" else 0.0)
            metric, order, value = scores[who] if isinstance(scores[who], tuple) else (*BEST, scores[who])
            start.wait(timeout=120)
            model_registry.register_model(config, run_id, f"{who}-{number}", records.Score(metric, order, value), log)
            done.wait(timeout=120)
    except BaseException:
        for barrier in (start, done, created):
            barrier.abort()
        raise


def _log_then_wait(model, example, created, later_s: float, *, name: str):
    """Log the model as a run does, then wait for the other process (and `later_s` more)."""
    from raytrain_ddp.registry import model_logging

    info = model_logging.log_pytorch_model(model, example, name=name)
    created.wait(timeout=120)
    time.sleep(later_s)
    return info
