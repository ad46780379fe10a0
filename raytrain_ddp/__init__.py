"""raytrain_ddp: distributed data-parallel PyTorch training on Ray.

from raytrain_ddp import load_config, run
summary = run(load_config("digits", overrides=["train.epochs=3"]))
"""

from raytrain_ddp.checkpoint.lease import RunBusy
from raytrain_ddp.config.layering import load_config, with_overrides
from raytrain_ddp.config.schema import Config, ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "RegistrationFailed",
    "RunBusy",
    "RunFailed",
    "RunInterrupted",
    "RunSummary",
    "load_config",
    "register",
    "run",
    "sweep",
    "with_overrides",
]

# torch, Ray Train and MLflow load on first use, so `--help` and config checks stay fast.
_LAZY = {
    "run": "raytrain_ddp.driver.run",
    "register": "raytrain_ddp.driver.registration",
    "RunSummary": "raytrain_ddp.driver.summary",
    "sweep": "raytrain_ddp.tuning.driver",
    "RunFailed": "raytrain_ddp.errors",
    "RunInterrupted": "raytrain_ddp.errors",
    "RegistrationFailed": "raytrain_ddp.errors",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
