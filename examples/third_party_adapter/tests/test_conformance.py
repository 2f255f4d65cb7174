"""dataplane's shipped conformance suite on this adapter: ``pip install -e '.[test]' && pytest``."""

from __future__ import annotations

from typing import Any

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.testing import ClientConformance


class TestSqliteConformance(ClientConformance):
    def make_client(self, **options: Any) -> DataPlaneClient:
        return dataplane.connect("sqlite://", **options)  # found through the entry point

    def make_limited_client(
        self, *, capacity_bytes: int | None = None, capacity_rows: int | None = None
    ) -> DataPlaneClient:
        return dataplane.connect("sqlite://", capacity_bytes=capacity_bytes, capacity_rows=capacity_rows)
