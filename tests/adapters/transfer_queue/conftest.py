"""Fixtures of the ``tq://`` tests: one local Ray per test module.

TransferQueue needs a Ray with spare CPUs (the controller and each storage unit take one). A module
that asks for ``ray_cluster`` starts one with 8 logical CPUs, shared by its tests, and stops it at
the end if it started it. (Tests marked ``tq`` or ``mooncake`` are skipped where the package is
missing: see ``tests/conftest.py``.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray for this module's tests (its workers import these test modules: they are on their path)."""
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
