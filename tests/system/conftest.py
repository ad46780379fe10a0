"""The system tier's local Ray: one for the whole session, shared by every test that trains in-process."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray shared by every test that trains: a cold start costs 10-20 s on 2 cores. Started as
    the service starts its own (session.OWN_RAY)."""
    import ray

    from raytrain_ddp.cluster.session import OWN_RAY

    ray.init(log_to_driver=False, logging_level=logging.ERROR, **OWN_RAY)
    yield
    ray.shutdown()
