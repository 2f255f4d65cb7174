"""The shipped conformance suite and state machine on ``mooncake://local`` (real Mooncake processes).

One deployment per module: a ``mooncake://local`` owner starts the master and a store server; every
client the suite makes joins it through ``join_url`` (a real second Mooncake client each time).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.testing import ClientConformance, make_state_machine

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="Mooncake is not installed (pip install 'dataplane[mooncake]')",
    ),
]

_OWNER: list[Any] = []
_SHARED: list[DataPlaneClient] = []


@pytest.fixture(scope="module", autouse=True)
def deployment() -> Iterator[Any]:
    owner = dataplane.connect("mooncake://local?segment_bytes=512MiB&timeout_s=120")
    _OWNER.append(owner)
    yield owner
    for c in _SHARED:
        c.close()
    _SHARED.clear()
    _OWNER.clear()
    owner.close()


def _join(**options: Any) -> DataPlaneClient:
    assert _OWNER, "the module's deployment fixture did not run"
    return dataplane.connect(_OWNER[0].store.join_url, **options)


class TestMooncakeConformance(ClientConformance):
    def make_client(self, **options: Any) -> DataPlaneClient:
        return _join(**options)


def _shared() -> DataPlaneClient:
    if not _SHARED:
        _SHARED.append(_join())
    return _SHARED[0]


TestMooncakeStateMachine = make_state_machine(_shared).TestCase
TestMooncakeStateMachine.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
