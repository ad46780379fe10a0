"""The TorchTrainer a run fits, and the process group's setup, lighter where Ray's internals allow.

- `lean_trainer`: Ray's TorchTrainer without two helper processes a run would start and not need: the
  placement-group cleaner (a detached actor that removes the workers' placement group if the
  controller dies: the driver does that, `capacity.release`), and the dataset manager of a run that
  gives it no Ray Dataset (what `data.shipped` sends travels with the loop).
- `torch_free_controller`: `ProcessGroupConfig` (torch_backend.py) in place of Ray's `TorchConfig`,
  whose module imports torch on the controller.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

from raytrain_ddp.ray_compat import enabled


def trainer_class() -> type[TorchTrainer]:
    if not enabled("lean_trainer"):
        return TorchTrainer
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        return TorchTrainer

    class LeanTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list:
            unneeded = (PlacementGroupCleanerCallback,) + (() if self.datasets else (DatasetsCallback,))
            return [c for c in super()._create_default_callbacks() if not isinstance(c, unneeded)]

    return LeanTrainer


def torch_config() -> Any:
    """TorchTrainer's `torch_config`: gloo on CPU workers, nccl on GPU ones, either way."""
    if enabled("torch_free_controller"):
        try:
            from raytrain_ddp.ray_compat.torch_backend import ProcessGroupConfig

            return ProcessGroupConfig()
        except ImportError:
            pass
    from ray.train.torch import TorchConfig

    return TorchConfig()
