"""The workers' torch process group, as Ray Train's TorchTrainer sets it up, from a module that
imports no torch.

Ray's own `TorchConfig` lives in a module that imports torch, and Ray Train's controller unpickles
the backend config (and the callbacks holding it) before it starts a worker: the controller, which
never touches a tensor, spent ~1.5 s of every run's start importing torch, on the path to the first
step. `ProcessGroupConfig` is the same setup, Ray's `TorchConfig(init_method="env")`: an `env://`
rendezvous at rank 0's address, nccl where the workers have GPUs, else gloo. What runs on the workers
is Ray's own code (`ray.train.torch.config`), imported there, where torch is loaded anyway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray._private.ray_constants import env_integer
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port, update_env_vars
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """TorchTrainer's `torch_config`: `backend` None is nccl for GPU workers, gloo otherwise (as
    TorchTrainer sets it); `timeout_s` bounds the process group's collectives."""

    backend: str | None = None
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type[Backend]:
        return _TorchBackend

    @property
    def train_func_context(self) -> Any:
        # Read on the driver, when the trainer wraps the training function (torch is loaded there).
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


def _on_worker(name: str, *args, **kwargs) -> Any:
    """Ray's own step `name` of its torch backend, run on a worker."""
    from ray.train.torch import config

    return getattr(config, name)(*args, **kwargs)


class _TorchBackend(Backend):
    """Ray's `_TorchBackend` (its GPU and CPU path), on the controller without torch."""

    share_cuda_visible_devices = True  # GPU workers of a node see each other's devices (nccl)

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        gpus = worker_group.get_resources_per_worker().get("GPU", 0)
        backend = backend_config.backend or ("nccl" if gpus > 0 else "gloo")
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(update_env_vars, {"MASTER_ADDR": address, "MASTER_PORT": port})
        worker_group.execute(_on_worker, "_set_torch_distributed_env_vars")  # RANK, LOCAL_RANK, ...
        setups = [
            worker_group.execute_single_async(
                rank,
                _on_worker,
                "_setup_torch_process_group",
                backend=backend,
                world_rank=rank,
                world_size=len(worker_group),
                init_method="env://",
                timeout_s=backend_config.timeout_s,
            )
            for rank in range(len(worker_group))
        ]
        ray.get(setups)

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        stopped = worker_group.execute_async(_on_worker, "_shutdown_torch", destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(stopped, timeout=timeout_s)
        except GetTimeoutError:  # as Ray's: the workers are stopped next all the same
            logger.warning("torch process group shutdown timed out after %s s", timeout_s)
