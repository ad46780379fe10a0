"""What the cluster holds now, for a run whose workers wait for resources: whether they fit on the
nodes alive this moment, and if not, what is free and which other runs hold the rest.

Ray places a worker group all at once or not at all, and while it cannot, it waits: at the start
(another run holds the resources, an autoscaler is adding nodes) and after a node is lost (its
replacement may come, or not). The driver says what the run waits for while it waits (console.py),
refuses at once if asked to (`run.resources_wait_s=0`, preflight.py) and gives up after
`run.resources_wait_s`; these are the words it uses.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import Any

import ray

from raytrain_ddp.config.schema import Config
from raytrain_ddp.ray_compat import cluster as ray_compat

logger = logging.getLogger(__name__)


def per_worker(config: Config) -> dict[str, float]:
    """One worker's resources, as Ray Train asks for them (a GPU each where use_gpu says so)."""
    s = config.scaling
    return dict(s.resources_per_worker) | ({"GPU": s.resources_per_worker.get("GPU", 1.0)} if s.use_gpu else {})


def fits_now(config: Config) -> bool:
    """Whether the run's workers (an elastic run's least) fit in what the alive nodes (those with
    scaling.label_selector's labels) have free now: one worker after another onto the first node with
    room, as Ray's PACK strategy places them."""
    wanted, selector = per_worker(config), dict(config.scaling.label_selector)
    free = [dict(node["free"]) for node in _nodes() if has_labels(node["labels"], selector)]
    for _ in range(config.scaling.min_workers):
        node = next((n for n in free if all(n.get(k, 0.0) >= v for k, v in wanted.items())), None)
        if node is None:
            return False
        for key, amount in wanted.items():
            node[key] -= amount
    return True


def placement(config: Config, nodes: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """How many of the run's workers each node (by id) will hold, where Ray has no choice of their
    nodes: the one node with scaling.label_selector's labels and room for workers free now (as many
    as it holds, up to the run's most), or nodes whose rooms add up to exactly the run's most workers.
    {} where Ray chooses (Ray Train's PACK strategy picks its own nodes) or nothing fits. `nodes`: the
    alive nodes as `_nodes` gives them (the default)."""
    wanted, selector = per_worker(config), dict(config.scaling.label_selector)
    nodes = _nodes() if nodes is None else nodes
    rooms = {node["id"]: _room(node["free"], wanted) for node in nodes if has_labels(node["labels"], selector)}
    rooms = {node: room for node, room in rooms.items() if room > 0}
    most = config.scaling.max_workers
    if len(rooms) == 1:
        return {node: min(room, most) for node, room in rooms.items()}
    return rooms if sum(rooms.values()) == most else {}


def _room(free: dict[str, float], wanted: dict[str, float]) -> int:
    """How many workers of `wanted` resources `free` holds."""
    return min((int(free.get(key, 0.0) // amount) for key, amount in wanted.items() if amount > 0), default=0)


def describe_wait(config: Config) -> str:
    """What the run waits for and what the cluster has: the workers' resources, the nodes alive with
    what they have free, and the other runs of the cluster that hold workers now."""
    s, nodes, wanted = config.scaling, _nodes(), per_worker(config)
    free = {key: sum(node["free"].get(key, 0.0) for node in nodes) for key in wanted}
    total = {key: sum(node["total"].get(key, 0.0) for node in nodes) for key in wanted}
    has = ", ".join(f"{key} {free[key]:g} free of {total[key]:g}" for key in wanted)
    said = f"{s.workers_text} × {_describe(wanted)}; the cluster has {len(nodes)} node(s) alive, {has}"
    if s.label_selector:
        said += f" (workers only on nodes labelled {labels_text(s.label_selector)})"
    others = holders(config.run.name)
    return said + (f"; held by {'; '.join(others)}" if others else "")


def holders(own_name: str | None) -> list[str]:
    """The other Ray Train runs of the cluster whose workers are placed now: 'run NAME (job ID, N
    workers × RESOURCES)' from Ray Train's state actor (what its dashboard shows: on where
    session.fit_environment turns it on), else 'N training workers of job ID' from Ray's actors."""
    recorded = ray_compat.train_runs()
    if recorded is None:
        return _worker_jobs()
    runs, attempts = recorded
    found = []
    for run_id, run in runs.items():
        if str(getattr(run.status, "value", run.status)) != "RUNNING" or run.name == own_name:
            continue
        latest = max((attempts.get(run_id) or {}).values(), key=lambda a: a.start_time_ns, default=None)
        workers = len(latest.resources) if latest is not None else 0
        each = _describe(latest.resources[0].resources) if workers else "?"
        found.append(f"run {run.name} (job {run.job_id}, {workers} workers × {each})")
    return found


def _worker_jobs() -> list[str]:
    """'N training workers of job ID' for every other job with Ray Train workers alive."""
    from ray.util.state import list_actors

    try:
        workers = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")], timeout=10)
    except Exception as e:  # noqa: BLE001 - as above
        logger.debug("Ray's actors not listed: %s", e)
        return []
    own = ray.get_runtime_context().get_job_id()
    jobs: dict[str, int] = {}
    for worker in workers:
        if worker.job_id != own:
            jobs[worker.job_id] = jobs.get(worker.job_id, 0) + 1
    return [f"{count} training workers of job {job}" for job, count in sorted(jobs.items())]


def withdraw(run_id: str) -> None:
    """Withdraw the request for the workers' resources that Ray Train's controller of run `run_id`
    made to Ray's autoscaling coordinator (every run makes one, at start). The controller withdraws it
    as it shuts down; one killed cannot, and the request would hold its reservation for 3 minutes
    (AUTOSCALING_REQUESTS_EXPIRE_TIME_S), where an elastic run and Ray Data count room from it."""
    ray_compat.withdraw_request(f"train-{run_id}")


def placement_groups() -> dict[str, str]:
    """The placement groups of this driver's job (a group's id ends with its job's) that are not
    removed, with their state (PENDING, CREATED, RESCHEDULING): what its Ray Train runs hold or wait
    for, and any of the driver's own. Empty where Ray does not answer."""
    from ray.util.placement_group import placement_group_table

    try:
        job, table = ray.get_runtime_context().get_job_id(), placement_group_table()
    except Exception:  # noqa: BLE001 - no answer (Ray gone: the job's groups with it)
        return {}
    return {id_: pg["state"] for id_, pg in table.items() if id_.endswith(job) and pg["state"] != "REMOVED"}


def release(kept: Iterable[str], own: str | None = None) -> None:
    """Remove the run's workers' placement group once its fit() has ended in a failure: `own`, its
    hex id where the controller said it (another run of the same driver's job, a sweep's trial, may
    hold a group of its own); else, and where `own` is gone already (a restart's group, pending, is
    not said), every group this driver's job has but those in `kept` (what it had before the run's
    fit(): a notebook's own).

    Ray Train's controller removes its workers' group as it ends; one that died, or that the driver
    killed (run.resources_wait_s), leaves it behind: a placement group outlives the actor that created
    it and goes only with its job, so until the driver exits (a notebook's kernel) it would hold the
    workers' resources, or take them once they come. Ray Train's own cleaner for this, a detached
    actor that watches the controller, is one more process to start in every run; the driver, which
    sees the run fail anyway, does it instead (ray_compat `lean_trainer`)."""
    current = placement_groups()
    for id_ in [own] if own in current else current.keys() - set(kept):
        remove(id_)


def remove(id_: str) -> None:
    """Remove the placement group of hex id `id_`, if it is still there."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    if placement_groups().get(id_) is None:
        return
    try:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(id_))))
    except Exception as e:  # noqa: BLE001 - the run's own error is what the user needs to see
        logger.warning("the run's placement group %s was not removed: %s", id_, e)


def lost_nodes(ranks: dict[int, str]) -> list[str]:
    """Of the nodes the ranks ran on ({rank: node id}), those lost: 'node IP (id ID) was lost, with
    rank(s) R'. A node is lost when Ray has marked it dead or, sooner (Ray takes seconds to), when
    its raylet no longer accepts a connection."""
    known = {node["NodeID"]: node for node in ray.nodes()}
    lost = []
    for node_id in sorted(set(ranks.values())):
        node = known.get(node_id)
        if node is None or not node["Alive"] or not _answers(node["NodeManagerAddress"], node["NodeManagerPort"]):
            ip = node["NodeManagerAddress"] if node else "?"
            on = ", ".join(str(rank) for rank, where in sorted(ranks.items()) if where == node_id)
            lost.append(f"node {ip} (id {node_id[:8]}) was lost, with rank {on}")
    return lost


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _nodes() -> list[dict[str, Any]]:
    """The alive nodes: their ids, labels, total and free resources."""
    free = ray_compat.free_resources_per_node()
    return [
        {
            "id": node["NodeID"],
            "labels": node.get("Labels") or {},
            "total": node["Resources"],
            "free": free.get(node["NodeID"], node["Resources"]),
        }
        for node in ray.nodes()
        if node["Alive"]
    ]


def has_labels(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def labels_text(labels: dict[str, str]) -> str:
    """Labels as `ray start --labels` takes them, without Ray's own (ray.io/...)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if not k.startswith("ray.io/"))


def _describe(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
