"""A training worker's process as it starts: its modules loaded ahead (`preload`, Ray's worker setup
hook, asked for by `cluster.prestart`)."""

from __future__ import annotations


def preload() -> None:
    """A training worker's modules, loaded as its process starts. Never raises: Ray ends a worker whose
    setup hook fails, and the worker imports what failed here again, where the error is reported."""
    try:
        import torch.distributed  # noqa: F401

        from raytrain_ddp.ray_compat.prestart import preload_train_worker

        preload_train_worker()  # the worker actor's class

        import raytrain_ddp.worker.loop  # noqa: F401
    except BaseException:  # noqa: BLE001, S110 - an optimization only
        pass


def preload_ddp() -> None:
    """`preload`, and torch's compiler stack: DDP reads its config as it wraps the model."""
    preload()
    try:
        import torch._dynamo  # noqa: F401
    except BaseException:  # noqa: BLE001, S110
        pass
