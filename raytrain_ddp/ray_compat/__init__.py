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

# capability -> the Ray releases (major, minor) its private use was read in and tested on.
KNOWN_ON: dict[str, tuple[tuple[int, int], ...]] = {
    "prestart": ((2, 60),),  # the run's worker and controller processes started ahead (raylet's PrestartWorkers)
    "torch_free_controller": ((2, 60),),  # the controller sets up the process group without importing torch
    "lean_trainer": ((2, 60),),  # no placement-group cleaner and no dataset manager the run does not need
    "controller_callbacks": ((2, 60),),  # the worker group's phases, nodes, resizes and preemptions seen
    "autoscaling_coordinator": ((2, 60),),  # started ahead, recounted for elastic runs, a dead run's request withdrawn
    "cluster_state": ((2, 60),),  # free resources per node, the autoscaler's config, the runs that hold a cluster
    "own_raylet": ((2, 60),),  # the local Ray's monitor and worker processes ended with the command
    "system_config": ((2, 60),),  # a local Ray that keeps idle workers a minute and prestarts none for the driver
    "dataset_blocks": ((2, 60),),  # a materialized dataset's blocks read from its plan, not executed
}


@functools.cache
def ray_release() -> tuple[int, int]:
    import ray

    major, minor = ray.__version__.split(".")[:2]
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
    return ray_release() in KNOWN_ON[capability]


def states() -> dict[str, bool]:
    """Every capability, and whether it runs here (for the docs, the benchmark and bug reports)."""
    return {name: enabled(name) for name in KNOWN_ON}
