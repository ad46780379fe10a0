"""Whether the cluster can ever hold the run's workers, and whether it can now: resources, node
labels, what is free."""

from __future__ import annotations

from typing import Any

import ray
import ray.data
from ray.data.dataset import MaterializedDataset

from raytrain_ddp.cluster import capacity, session
from raytrain_ddp.config.schema import Config
from raytrain_ddp.data import stream


def check_resources(config: Config, datasets: dict[str, Any]) -> list[str]:
    """Whether the cluster can ever place the workers (an elastic run's least). Ray would otherwise wait
    forever, silently, for resources that will not come."""
    s, per_worker = config.scaling, capacity.per_worker(config)
    autoscaler = session.autoscaler_config()
    nodes = _node_shapes(autoscaler)
    most = {key: sum(node.get(key, 0.0) * count for node, count in nodes) for key in {"CPU", *per_worker}}
    where = ("at most, with the autoscaler" if autoscaler else f"{len(nodes)} node(s)") + f": {_describe(most)}"
    problems = []
    for key, amount in per_worker.items():
        if amount * s.min_workers > most.get(key, 0.0):
            fix = (
                "set scaling.use_gpu=false"
                if key == "GPU" and most.get("GPU", 0) == 0
                else ("lower scaling.num_workers or scaling.resources_per_worker")
            )
            problems.append(
                f"scaling: {s.min_workers} workers × {key} {amount:g} need {key} {amount * s.min_workers:g}, "
                f"the cluster has {most.get(key, 0.0):g} ({where}); {fix}"
            )
    if not problems and not any(all(node.get(k, 0.0) >= v for k, v in per_worker.items()) for node, _ in nodes):
        problems.append(
            f"scaling.resources_per_worker: no node can hold one worker's {_describe(per_worker)} "
            f"(nodes: {'; '.join(_describe(node) for node, _ in nodes)})"
        )
    lazy = [
        name
        for name, ds in datasets.items()
        if isinstance(ds, stream.Stream)
        or (isinstance(ds, ray.data.Dataset) and not isinstance(ds, MaterializedDataset))
    ]
    placed = min([s.max_workers, *(int(most.get(k, 0.0) // v) for k, v in per_worker.items() if v > 0)])
    left = most.get("CPU", 0.0) - per_worker.get("CPU", 0.0) * placed
    if not problems and lazy and left < 1:
        problems.append(
            f"scaling.resources_per_worker: the workers take {most['CPU'] - left:g} of {most['CPU']:g} CPUs, "
            f"and Ray Data needs one to run the pipeline of the streamed or unmaterialized dataset(s) "
            f"{', '.join(lazy)}: "
            "without it training waits forever; lower resources_per_worker.CPU (e.g. {CPU: 0.5}), "
            "or materialize them"
        )
    return problems


def check_free_now(config: Config) -> list[str]:
    """With run.resources_wait_s=0, whether the workers fit in what the cluster has free now (another
    run may hold it): refused at once rather than waiting."""
    if config.run.resources_wait_s > 0 or capacity.fits_now(config):
        return []
    return [
        f"run.resources_wait_s=0 and the workers do not fit now: {capacity.describe_wait(config)}; "
        "wait for the resources to be free, or set run.resources_wait_s to how long the run may wait for them"
    ]


def check_labels(config: Config) -> list[str]:
    """Whether a node has the labels that scaling.label_selector and data.label_selector ask for (with an
    autoscaler: a node type has them). Ray would otherwise wait forever for a node that will not come."""
    autoscaler = session.autoscaler_config()
    if autoscaler is not None and autoscaler.node_group_configs:
        found = [getattr(group, "labels", None) for group in autoscaler.node_group_configs]
    else:
        found = [node.get("Labels") for node in ray.nodes() if node["Alive"]]
    if any(labels is None for labels in found):  # this Ray does not say: nothing to check against
        return []
    nodes = [dict(labels) for labels in found]
    problems = []
    asked = {"scaling.label_selector": config.scaling.label_selector, "data.label_selector": config.data.label_selector}
    for key, selector in asked.items():
        if selector and not any(capacity.has_labels(labels, selector) for labels in nodes):
            wanted, has = capacity.labels_text(selector), "; ".join(capacity.labels_text(n) or "none" for n in nodes)
            problems.append(
                f"{key}: no node of the cluster has the labels {wanted} (they have: {has}); "
                f"start nodes with --labels {wanted}, or clear {key}"
            )
    return problems


def _node_shapes(config) -> list[tuple[dict[str, float], int]]:
    """(resources of one node, how many such nodes): the autoscaler's node types at their maximum
    counts where the cluster autoscales, else the nodes alive now."""
    if config is not None and config.node_group_configs:
        unlimited = 10**6
        return [
            (dict(group.resources), unlimited if group.max_count < 0 else group.max_count)
            for group in config.node_group_configs
        ]
    return [(node["Resources"], 1) for node in ray.nodes() if node["Alive"]]


def _describe(resources: dict[str, float]) -> str:
    shown = {
        k: v
        for k, v in resources.items()
        if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store"))
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items()) if v) or "nothing"
