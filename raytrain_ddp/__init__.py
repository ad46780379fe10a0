"""raytrain_ddp: distributed data-parallel PyTorch training on Ray.

from raytrain_ddp import load_config, run
summary = run(load_config("digits", overrides=["train.epochs=3"]))
"""

from raytrain_ddp.config import Config, ConfigError, load_config
from raytrain_ddp.lease import RunBusy

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
]


def __getattr__(name: str):
    # torch, Ray Train and MLflow load on first use, so `--help` and config checks stay fast.
    if name in ("run", "register", "RunSummary", "RunFailed", "RunInterrupted", "RegistrationFailed"):
        from raytrain_ddp import driver

        return getattr(driver, name)
    raise AttributeError(name)
