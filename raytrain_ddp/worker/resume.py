"""Where a worker resumes: the newest checkpoint that verifies (`ray.train.get_checkpoint()` first, then
what was written but not yet recorded), loaded into the model, the updater and every rank's random
state."""

from __future__ import annotations

import logging
from pathlib import Path

import ray.train
import ray.train.torch
import torch
from ray.train import CheckpointConsistencyMode, CheckpointUploadMode

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.config.schema import Config
from raytrain_ddp.worker import sharding
from raytrain_ddp.worker.metrics import (
    all_gather,
)
from raytrain_ddp.worker.optim import Updater
from raytrain_ddp.worker.timeline import strip as strip_marks

logger = logging.getLogger(__name__)


def resume(
    model: torch.nn.Module, updater: Updater, config: Config, world_size: int
) -> tuple[ckpt.TrainingState | None, frozenset[str]]:
    """Load the newest checkpoint of the run that verifies: one written and reported but not recorded
    by Ray (its worker died before the controller's poll: reported again here, so Ray records it),
    else Ray's latest, else (damaged, or mid-epoch for another number of workers) the newest committed
    one before it. Returns its training state (None for a new run, or an elastic one resized in its
    first epoch) and the names of the checkpoints skipped, which training will pass again and must
    not overwrite."""
    latest = ray.train.get_checkpoint()
    run_path = config.run.path
    unrecorded = ckpt.unrecorded(run_path, None if latest is None else Path(latest.path).name)
    if latest is None and not unrecorded:
        return None, frozenset()
    committed = ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    committed = ((c.checkpoint, c.metrics) for c in committed)
    elastic = config.scaling.elastic  # resized by Ray: in its first epoch, it may start over
    with ckpt.open_resume_point(latest, committed, unrecorded, world_size, start_over=elastic) as opened:
        if opened is None:  # nothing recorded, and nothing written whole
            return None, frozenset()
        for skipped in opened.skipped:
            logger.warning("skipping checkpoint %s", skipped)
        passed_over = frozenset(skipped.name for skipped in opened.skipped)
        chosen = all_gather(None if opened.checkpoint is None else opened.name)
        if len(set(chosen)) != 1:
            raise ckpt.CheckpointError(
                f"the ranks found different checkpoints valid ({chosen}): is the storage shared?"
            )
        if opened.checkpoint is None:  # every checkpoint mid-epoch 1, of another number of workers
            return None, passed_over
        _load_model(model, updater, opened)
        state = opened.verified.training_state()
        if not opened.recorded:
            _report_again(opened)
    if len(state.rng) != world_size and state.batches:  # open_resume_point passes them over
        raise RuntimeError(
            f"checkpoint {opened.name} is mid-epoch, written by {len(state.rng)} workers; this run has "
            f"{world_size}: resume with scaling.num_workers={len(state.rng)} to the epoch's end"
        )
    updater.load_state_dict(state.updater)
    return state, passed_over


def _load_model(model: torch.nn.Module, updater: Updater, opened: ckpt.Opened) -> None:
    """The checkpoint's weights into `model`; sharded, with the optimizer's state, into this rank's
    shards (resharded where another number of workers wrote them)."""
    verified, sharded = opened.verified, sharding.is_sharded(model)
    if verified.sharded != sharded:
        written, now = ("fsdp", "ddp") if verified.sharded else ("ddp", "fsdp")
        raise ckpt.CheckpointError(
            f"checkpoint {opened.name} was written under scaling.strategy={written}; this run trains under {now}: "
            f"resume it with scaling.strategy={written}"
        )
    if sharded:
        sharding.load(verified.directory / ckpt.SHARDS_DIR, model, updater.optimizer)
    else:
        ckpt.load_weights(model, verified.model_state())


def _report_again(opened: ckpt.Opened) -> None:
    """Report a checkpoint that is on storage but not in Ray's record, from every rank, with the
    metrics it was reported with: Ray records it where it is (nothing is copied), logs its metrics
    and ranks it among the run's checkpoints, as if the first report had reached the controller."""
    metrics = strip_marks(opened.verified.metrics())
    on_storage = opened.checkpoint if ray.train.get_context().get_world_rank() == 0 else None
    ray.train.report(
        metrics,
        checkpoint=on_storage,
        checkpoint_dir_name=opened.name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,  # on storage already, as a sync checkpoint is
    )
