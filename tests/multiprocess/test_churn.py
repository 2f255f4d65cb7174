"""Churn on every multi-process backend: two writer processes rewrite and clear the same keys while two
reader processes get them (:mod:`dataplane.testing.churn`). Readers see only ``KeyNotFound`` for rows
cleared under them, never another error, and every row they get is exactly one a writer wrote.

Every backend in CI, a couple of seconds of churn each (the ``tq://`` cases run on the session's Ray,
``ray_cluster`` in ``tests/conftest.py``); ``test_churn_soak`` runs a minute each, with short rows and
long ones. The test process owns each deployment, and the churn processes join it by URL
(``join_url`` on Mooncake; on ``tq://``, ``ray_address=`` that Ray, which the TransferQueue
deployments use in turn).

TransferQueue hands a cleared row's global index to the next new key and keeps the row's bytes under
that index, so a get that took a row's index before a clear can find another key's row there (seen
here before rows were stamped: ``k31`` read as ``k0``'s row, and ``k22``'s field ``y`` as ``k11``'s
when the stamp was an object of its own). Every row's bytes carry its key's hash: in the row blob on
``backend=simple``, in the name of each of the row's Mooncake objects on ``backend=mooncake``.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.testing.churn import PARTITION, run_churn

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None

pytestmark = [pytest.mark.multiprocess]

CHURN_SECONDS = 2.0
SOAK_SECONDS = 60.0

MOONCAKE = pytest.param("mooncake://local?segment_bytes=256MiB", marks=pytest.mark.mooncake, id="mooncake")
TQ_SIMPLE = pytest.param("tq://?backend=simple", marks=pytest.mark.tq, id="tq-simple")
TQ_MOONCAKE = pytest.param(
    "tq://?backend=mooncake&segment_bytes=268435456",
    marks=[
        pytest.mark.tq,
        pytest.mark.skipif(not HAVE_MOONCAKE, reason="needs Mooncake"),
    ],
    id="tq-mooncake",
)


@pytest.fixture
def ray_address(ray_cluster: None) -> str:
    """The address processes join the session's Ray by (``tests/conftest.py``: started on first use,
    shared with the other in-process ``tq://`` tests)."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def _owner(url: str, request: pytest.FixtureRequest) -> tuple[DataPlaneClient, str]:
    """The deployment's owner and the URL other processes join it by."""
    if url.startswith("tq://"):
        address = request.getfixturevalue("ray_address")
        return dataplane.connect(url), f"tq://?ray_address={address}"
    owner = dataplane.connect(url)
    return owner, owner.store.join_url  # type: ignore[attr-defined]


def _churn(url: str, request: pytest.FixtureRequest, seconds: float, scale: int = 1) -> None:
    owner, join = _owner(url, request)
    try:
        t0 = time.monotonic()
        report = run_churn(join, seconds=seconds, scale=scale)
        print(f"{url}: {report.summary()} in {time.monotonic() - t0:.1f} s")  # shown with -s
        assert not report.problems, report.problems
        assert not report.noise, f"the churn's processes logged to stderr: {report.noise[:10]}"
        assert report.ok, f"a process made no progress: {report}"
    finally:
        try:
            owner.kv_clear(partition_id=PARTITION)
        finally:
            owner.close()


# tq-simple churns in the soak test only (its processes cost CI ~20 s; its row blobs are written whole
# by construction, and its puts and clears stay in CI through the conformance suite); tq-mooncake,
# whose reads race puts of new objects and removals of replaced ones, churns in CI too
@pytest.mark.parametrize("url", [MOONCAKE, TQ_MOONCAKE])
def test_readers_see_only_whole_rows_or_key_not_found(url: str, request: pytest.FixtureRequest) -> None:
    _churn(url, request, CHURN_SECONDS)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.parametrize("url", [MOONCAKE, TQ_SIMPLE, TQ_MOONCAKE])
@pytest.mark.parametrize("scale", [1, 400], ids=["short-rows", "long-rows"])
def test_churn_soak(url: str, scale: int, request: pytest.FixtureRequest) -> None:
    """The churn above for a minute, with short rows and with rows of up to 5,200 tokens."""
    _churn(url, request, SOAK_SECONDS, scale)
