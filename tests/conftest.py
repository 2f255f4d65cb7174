"""Shared test configuration: hypothesis profiles, skips for absent backends, and soak selection.

Hypothesis profiles (``HYPOTHESIS_PROFILE`` picks one; otherwise ``ci`` where ``CI`` is set, else ``dev``):

- ``dev``: hypothesis' default budget, a fresh random search each run.
- ``ci``: fewer examples and derandomised, so a CI run is repeatable and bounded.

Both have no deadline: a shared 2-core host makes single examples slow now and then.

``ray_cluster``: one local Ray per test process (an xdist worker), started by the first module that asks
for it, shared by the modules that run TransferQueue in-process, and stopped once the process has
moved on to files without ``tq`` tests.

Tests marked ``soak`` (long variants of churn tests) are deselected unless ``DATAPLANE_SOAK=1`` or a
``-m`` expression names ``soak`` (see ``tests/README.md``).

Under pytest-xdist (``-n 2 --dist loadfile``, what CI runs) the slowest test files are handed out first
(:func:`_file_cost`), so that the run ends on short files instead of one worker finishing a long one
alone.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci",
    max_examples=30,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

# Tests that start processes (not GPU ranks) fork them from one forkserver that has imported these once:
# a fresh process with nothing started in it, ready in a fraction of a second instead of the 5+
# CPU-seconds a spawned interpreter spends importing torch and dataplane. (The forkserver does not see
# the sys.path entries pytest adds, so test modules themselves are imported by each child.)
multiprocessing.set_forkserver_preload(["torch", "dataplane", "dataplane.testing", "pytest"])

ROOT = Path(__file__).resolve().parents[1]

SOAK = os.environ.get("DATAPLANE_SOAK", "") not in ("", "0")

# marker -> the modules it needs and how to get them
_NEEDS = {
    "mooncake": (("mooncake",), "needs Mooncake Store (pip install 'dataplane[mooncake]')"),
    "tq": (("transfer_queue", "ray"), "needs TransferQueue and Ray (pip install 'dataplane[tq]')"),
}
_MISSING = {
    marker: reason
    for marker, (modules, reason) in _NEEDS.items()
    if any(importlib.util.find_spec(m) is None for m in modules)
}


# Non-empty while a Ray that ray_cluster started is up, and the test files that may use it: those with a
# test marked tq. Only filled on xdist workers (pytest_collection_modifyitems), where those files come
# first (_slowest_files_first): a serial run keeps its Ray to the end instead of restarting it for each
# tq file after a file without.
_ray_started_here: list[bool] = []
_RAY_FILES: set[str] = set()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray with 8 logical CPUs (TransferQueue's controller and each storage unit take one), for
    the in-process ``tq://`` tests of this process: a Ray start costs ~10 CPU-seconds, so the test
    modules share one (each test or class runs its own deployment on it). Its workers import the
    repository and the test modules (actors defined there are pickled by reference).

    A module that uses it marks its tests ``tq``: under xdist, the Ray started here is stopped before
    the first test of a file with no such test (an idle Ray's daemons take a few percent of a core, for
    the rest of the run otherwise), and started again by the next module that asks for it; at the
    latest it stops at the end of the session."""
    import ray

    if not ray.is_initialized():
        # every test folder too (test module basenames are unique): a module's actors may be pickled by reference
        paths = [ROOT, *sorted({test.parent for test in (ROOT / "tests").rglob("test_*.py")})]
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(map(str, paths))}},
        )
        _ray_started_here[:] = [True]
    yield


def _stop_our_ray() -> None:
    if _ray_started_here:
        import ray

        ray.shutdown()
        _ray_started_here.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _ray_started_here and _RAY_FILES and item.nodeid.split("::", 1)[0] not in _RAY_FILES:
        _stop_our_ray()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_our_ray()


def pytest_configure(config: pytest.Config) -> None:
    # xdist's --dist loadfile hands out files by number of tests, most first (--loadscope-reorder, on
    # by default): that put the files of two or three slow tests (a Ray and a TransferQueue each, the
    # README's recipe in subprocesses) last, where one worker ran them alone for minutes. Keep the
    # order _file_cost gives the collection instead.
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


def _file_cost(items: list[pytest.Item]) -> tuple[bool, int, int]:
    """How slow a test file is, roughly, as a sort key: whether it starts a Ray (``tq``), how many of
    its tests start processes or are marked slow (GPU tests aside: skipped on CPU hosts), then its
    number of tests."""

    def marked(item: pytest.Item, name: str) -> bool:
        return item.get_closest_marker(name) is not None

    ray = any(marked(i, "tq") for i in items)
    heavy = sum(1 for i in items if (marked(i, "multiprocess") or marked(i, "slow")) and not marked(i, "gpu"))
    return ray, heavy, len(items)


def _slowest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` file by file, the costliest files (:func:`_file_cost`) first; a file's own
    tests keep their order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(files.values(), key=_file_cost, reverse=True)  # stable: ties keep collection order
    items[:] = [item for file_items in ordered for item in file_items]


def _soak(config: pytest.Config) -> bool:
    """Whether soak tests are collected: asked for by DATAPLANE_SOAK=1, or left to a ``-m`` naming them."""
    return SOAK or "soak" in (config.getoption("markexpr") or "")


def pytest_report_header(config: pytest.Config) -> str:
    soak = "selected" if _soak(config) else "deselected (DATAPLANE_SOAK=1 or -m soak selects them)"
    return f"hypothesis profile: {settings.get_current_profile_name()}; soak tests: {soak}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests whose backend is not installed (by marker); deselect soak tests unless asked for."""
    soak = _soak(config)
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        if item.get_closest_marker("soak") is not None and not soak:
            dropped.append(item)
            continue
        for marker, reason in _MISSING.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if hasattr(config, "workerinput"):  # an xdist worker: its order is the order files are handed out in
        _slowest_files_first(items)
        _RAY_FILES.update(i.nodeid.split("::", 1)[0] for i in items if i.get_closest_marker("tq") is not None)
