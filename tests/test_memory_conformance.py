"""The shipped conformance suite on the memory adapter."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.testing import ClientConformance, make_state_machine


class TestMemoryConformance(ClientConformance):
    def make_client(self, **options: Any) -> DataPlaneClient:
        return dataplane.connect("memory://", **options)

    def make_limited_client(
        self, *, capacity_bytes: int | None = None, capacity_rows: int | None = None
    ) -> DataPlaneClient:
        return dataplane.connect("memory://", capacity_bytes=capacity_bytes, capacity_rows=capacity_rows)


_shared = dataplane.connect("memory://state-machine")
TestMemoryStateMachine = make_state_machine(lambda: _shared).TestCase
TestMemoryStateMachine.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
)
