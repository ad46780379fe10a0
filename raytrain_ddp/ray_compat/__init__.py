"""The one door to Ray's private internals: each use a named capability with a public fallback.

A capability's fast path runs only where the Ray installed is a release it is known on (`KNOWN_ON`)
and the switch leaves it on; anywhere else the service takes Ray's public path, so a Ray release it
has not seen runs (slower to start, or with less said on the console) instead of failing.

    RAYTRAIN_DDP_RAY_INTERNALS=off                  every capability off: Ray's public API only
    RAYTRAIN_DDP_RAY_INTERNALS=-prestart,-lean_trainer   those off, the rest as usual

docs/ray-versions.md lists each capability: what it does, what it buys, the releases it is known on.
Nothing outside this package imports a private Ray module (ruff's TID251 in `make lint`).
"""

from __future__ import annotations

import functools
import os

SWITCH_ENV = "RAYTRAIN_DDP_RAY_INTERNALS"

SUPPORTED = ((2, 55), (2, 60))  # the Ray releases the service runs on (pyproject.toml's range), oldest first
# capability -> the Ray releases (major, minor), first and last, its private use was read in and tested on.
KNOWN_ON: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "prestart": SUPPORTED,  # the run's worker and controller processes started ahead (raylet's PrestartWorkers)
    "torch_free_controller": SUPPORTED,  # the controller sets up the process group without importing torch
    "lean_trainer": SUPPORTED,  # no placement-group cleaner, no dataset manager the run does not need
    "controller_callbacks": SUPPORTED,  # the worker group's phases, nodes, resizes and preemptions seen
    "autoscaling_coordinator": SUPPORTED,  # a dead run's request withdrawn
    "elastic_recount": ((2, 60), (2, 60)),  # the coordinator recounts the nodes before each resize check
    "cluster_state": SUPPORTED,  # free resources per node, the autoscaler's config, the runs holding a cluster
    "own_raylet": SUPPORTED,  # the local Ray's monitor and worker processes ended with the command
    "system_config": SUPPORTED,  # a local Ray that keeps idle workers a minute and prestarts none for the driver
    "dataset_blocks": SUPPORTED,  # a materialized dataset's blocks read from its plan, not executed
}


@functools.cache
def ray_release() -> tuple[int, int]:
    """The installed Ray's (major, minor), read from its metadata: no import of Ray."""
    import importlib.metadata

    major, minor = importlib.metadata.version("ray").split(".")[:2]
    return int(major), int(minor)


def enabled(capability: str) -> bool:
    """Whether `capability`'s fast path runs here: known on this Ray release and not switched off."""
    if capability not in KNOWN_ON:
        raise KeyError(f"unknown Ray capability {capability!r}; known: {', '.join(KNOWN_ON)}")
    switch = os.environ.get(SWITCH_ENV, "on").strip().lower()
    if switch in ("off", "0", "false", "none"):
        return False
    if f"-{capability}" in {part.strip() for part in switch.split(",")}:
        return False
    first, last = KNOWN_ON[capability]
    return first <= ray_release() <= last


def switched_off(*capabilities: str) -> str:
    """The switch's value (RAYTRAIN_DDP_RAY_INTERNALS) with `capabilities` off as well as what it says."""
    switch = os.environ.get(SWITCH_ENV, "on").strip()
    if switch.lower() in ("off", "0", "false", "none"):
        return switch
    kept = [] if switch.lower() in ("on", "") else [switch]
    return ",".join([*kept, *(f"-{c}" for c in capabilities)])


def states() -> dict[str, bool]:
    """Every capability, and whether it runs here (for the docs, the benchmark and bug reports)."""
    return {name: enabled(name) for name in KNOWN_ON}
