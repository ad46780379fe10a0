"""Where the driver may start the workers' processes ahead (prestart.py): only where Ray has no choice
of their nodes, from what the nodes have free. The nodes are given as `capacity._nodes` reads them
from Ray; tests/system/test_node_loss.py checks the processes on a real 2-node cluster,
test_training.py on one node, and test_ray_up.py for a job submitted with a working directory.

    .venv/bin/pytest tests/unit/test_placement.py
"""

from __future__ import annotations

from pathlib import Path

from raytrain_ddp import load_config
from raytrain_ddp.cluster import capacity, prestart

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


def node(name: str, cpus: float, role: str = "train") -> dict:
    return {"id": name, "labels": {"role": role}, "total": {"CPU": 2.0}, "free": {"CPU": cpus}}


def placement(nodes: list[dict], *overrides: str) -> dict[str, int]:
    return capacity.placement(load_config(TINY, overrides=list(overrides)), nodes)


def test_one_node_with_room_gets_every_worker_it_holds_up_to_the_runs_most():
    assert placement([node("a", 2.0)], "scaling.num_workers=2", "scaling.resources_per_worker={CPU: 0.5}") == {"a": 2}
    elastic = ("scaling.num_workers=[1, 2]", "scaling.resources_per_worker={CPU: 1}")
    assert placement([node("a", 1.0), node("b", 0.2)], *elastic) == {"a": 1}  # the one node with room


def test_nodes_whose_rooms_add_up_to_exactly_the_workers_get_their_rooms():
    one_each = ("scaling.num_workers=2", "scaling.resources_per_worker={CPU: 1.5}")
    assert placement([node("a", 2.0), node("b", 2.0)], *one_each) == {"a": 1, "b": 1}
    assert placement([node("a", 2.0), node("b", 2.0), node("c", 0.4)], *one_each) == {"a": 1, "b": 1}


def test_where_ray_chooses_or_nothing_fits_none():
    two = ("scaling.num_workers=2", "scaling.resources_per_worker={CPU: 1}")
    assert placement([node("a", 2.0), node("b", 2.0)], *two) == {}  # room for 4: Ray picks the nodes
    assert placement([node("a", 0.5), node("b", 0.5)], *two) == {}  # held by another run
    assert placement([node("a", 2.0), node("b", 2.0)], *two, "scaling.use_gpu=true") == {}  # no GPU here


def test_only_nodes_with_the_selectors_labels_count():
    two = ("scaling.num_workers=2", "scaling.resources_per_worker={CPU: 1}")
    nodes = [node("a", 2.0, role="train"), node("b", 2.0, role="data")]
    assert placement(nodes, *two, "scaling.label_selector={role: train}") == {"a": 2}
    assert placement(nodes, *two, "scaling.label_selector={role: gpu}") == {}


def test_a_jobs_runtime_environment_is_merged_into_the_runs_as_rays_core_worker_merges_it():
    """Under `ray job submit --working-dir` the driver has a runtime environment, which Ray's core worker
    merges into every actor's (`OverrideRuntimeEnv`: the actor's keys win, environment variables merged)
    and writes compact with sorted keys: the processes asked for ahead must carry the same string."""
    job = {"working_dir": "gcs://_ray_pkg_1.zip", "env_vars": {"A": "job", "B": "job"}}
    merged = prestart._merged(job, {"env_vars": {"B": "run", "C": "run"}})
    assert merged == {"working_dir": "gcs://_ray_pkg_1.zip", "env_vars": {"A": "job", "B": "run", "C": "run"}}
    kept = {"py_modules": ["m"], "env_vars": {"C": "1"}}  # the job's keys the actor has not: kept
    assert prestart._merged({"py_modules": ["m"]}, {"env_vars": {"C": "1"}}) == kept
    assert prestart._merged({}, {"env_vars": {"C": "run"}}) == {"env_vars": {"C": "run"}}
    written = '{"env_vars":{"A":"job","B":"run","C":"run"},"working_dir":"gcs://_ray_pkg_1.zip"}'
    assert prestart._as_an_actor_sends(merged) == written
    assert prestart._as_an_actor_sends({"env_vars": {"NAME": "é"}}) == '{"env_vars":{"NAME":"é"}}'  # UTF-8, unescaped
