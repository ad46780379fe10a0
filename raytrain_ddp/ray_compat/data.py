"""A materialized dataset's blocks, read from its plan (`dataset_blocks`): Ray Data's first execution
in a process starts its executor and creates the cluster's stats actor, one more process while the run
starts. The public path executes the plan (`iter_internal_ref_bundles`)."""

from __future__ import annotations

from typing import Any

from raytrain_ddp.ray_compat import enabled


def bundles(dataset: Any) -> list:
    """A materialized dataset's bundles of blocks."""
    if enabled("dataset_blocks"):
        try:
            output_data = getattr(dataset._logical_plan.dag, "output_data", None)
            found = output_data() if callable(output_data) else None
            if found is not None:
                return list(found)
        except AttributeError:  # Ray Data's internals changed: execute it
            pass
    return list(dataset.iter_internal_ref_bundles())
