"""The shipped conformance suite and state machine on ``mooncake://local`` (real Mooncake processes).

One deployment per mode: a ``mooncake://local`` owner starts the master and a store server (a real
client reached through shared memory, or a plain one reached over TCP); every client the suite
makes joins it through ``join_url`` (a real second Mooncake client each time). Shared-memory clients
decode their gets on a helper thread, TCP ones in line, so both of the client's get paths run here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.store_client import DECODE_THREAD_ENV
from dataplane.testing import ClientConformance, make_state_machine

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="Mooncake is not installed (pip install 'dataplane[mooncake]')",
    ),
]

_OWNERS: dict[bool, Any] = {}  # shm -> the mooncake://local owner of that mode
_SHARED: dict[bool, DataPlaneClient] = {}
_CURRENT: list[bool] = []  # the mode whose deployment the conformance class runs on now


def _owner(shm: bool) -> Any:
    if shm not in _OWNERS:
        _OWNERS[shm] = dataplane.connect(f"mooncake://local?segment_bytes=512MiB&timeout_s=120&shm={shm}")
    return _OWNERS[shm]


@pytest.fixture(scope="module", autouse=True)
def _stop_deployments() -> Iterator[None]:
    yield
    for c in (*_SHARED.values(), *_OWNERS.values()):
        c.close()
    _SHARED.clear()
    _OWNERS.clear()


@pytest.fixture(scope="module", params=[True, False], ids=["shm", "tcp"])
def deployment(request: pytest.FixtureRequest) -> Iterator[Any]:
    _CURRENT[:] = [request.param]
    yield _owner(request.param)
    _CURRENT.clear()


@contextlib.contextmanager
def _decode_thread(shm: bool) -> Iterator[None]:
    """Clients of the shared-memory deployment decode beside the transfer (what hosts of 4+ cores do),
    those of the TCP one before it (what this 2-core CI does): the suite covers both paths."""
    old = os.environ.get(DECODE_THREAD_ENV)
    os.environ[DECODE_THREAD_ENV] = "1" if shm else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[DECODE_THREAD_ENV]
        else:
            os.environ[DECODE_THREAD_ENV] = old


def _join(**options: Any) -> DataPlaneClient:
    assert _CURRENT, "the deployment fixture did not run"
    with _decode_thread(_CURRENT[0]):
        c = dataplane.connect(_owner(_CURRENT[0]).store.join_url, **options)
    assert (getattr(c, "_beside", None) is not None) == _CURRENT[0]
    return c


class TestMooncakeConformance(ClientConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, deployment: Any) -> Iterator[DataPlaneClient]:  # one per deployment (mode)
        c = cls().make_client()
        yield c
        c.close()

    def make_client(self, **options: Any) -> DataPlaneClient:
        return _join(**options)


def _shared(shm: bool) -> DataPlaneClient:
    if shm not in _SHARED:
        with _decode_thread(shm):
            _SHARED[shm] = dataplane.connect(_owner(shm).store.join_url)
    return _SHARED[shm]


_SETTINGS = settings(max_examples=40, stateful_step_count=20, suppress_health_check=list(HealthCheck))
TestMooncakeStateMachineShm = make_state_machine(lambda: _shared(True)).TestCase
TestMooncakeStateMachineShm.settings = _SETTINGS
TestMooncakeStateMachineTcp = make_state_machine(lambda: _shared(False)).TestCase
TestMooncakeStateMachineTcp.settings = _SETTINGS
