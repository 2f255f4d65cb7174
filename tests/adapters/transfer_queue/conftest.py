"""Fixtures of the ``tq://`` tests: one local Ray for all of them.

TransferQueue needs a Ray with spare CPUs (the controller and each storage unit take one). The first
test that asks for ``ray_cluster`` starts one with 8 logical CPUs, shared by every ``tq://`` test
module (each test or class runs its own deployment on it), and it stops at the end of the session
if this fixture started it. (Tests marked ``tq`` or ``mooncake`` are skipped where the package is
missing: see ``tests/conftest.py``.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray for the tq:// tests (its workers import these test modules: they are on their path)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}},
        )
    try:
        yield
    finally:
        if started:
            ray.shutdown()
