"""Helpers shared by the ``tests/test_tq_*.py`` modules (imported by them; not a pytest conftest).

Each module starts one local Ray for all its tests (TransferQueue needs a Ray with spare CPUs:
the controller and each storage unit take one) and stops it at the end, if it started it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

MISSING = [m for m in ("transfer_queue", "ray") if importlib.util.find_spec(m) is None]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None

requires_tq = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (pip install 'dataplane[tq]')")
requires_mooncake = pytest.mark.skipif(
    not HAVE_MOONCAKE, reason="needs Mooncake Store (pip install 'dataplane[mooncake]')"
)


def ray_for_module() -> Iterator[None]:
    """Body of a module-scoped fixture: a local Ray with 8 logical CPUs, stopped at the end if ours."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}},
        )
    try:
        yield
    finally:
        if started:
            ray.shutdown()
