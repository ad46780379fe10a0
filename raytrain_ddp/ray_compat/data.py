"""A materialized dataset's blocks, read from its plan (`dataset_blocks`): Ray Data's first execution
in a process starts its executor and creates the cluster's stats actor, one more process while the run
starts. The public path executes the plan (`iter_internal_ref_bundles`). Either way the blocks come as
Ray Data's bundles, whose entries changed form in Ray 2.56 (`blocks`)."""

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


def blocks(dataset: Any) -> list[tuple[Any, int, int | None]] | None:
    """A materialized dataset's blocks as (object ref, first row, rows), or None where Ray Data's
    bundles cannot say (its internals changed): the caller then reads the dataset through Ray Data."""
    found = []
    try:
        for bundle in bundles(dataset):
            for entry, part in zip(bundle.blocks, bundle.slices):
                # a BlockEntry from Ray 2.56 on, a (ref, metadata) tuple before
                ref, metadata = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
                found.append((ref, 0, metadata.num_rows) if part is None else (ref, part.start_offset, part.num_rows))
    except Exception:  # noqa: BLE001 - Ray Data's internals changed
        return None
    return found
