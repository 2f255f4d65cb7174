"""What a backend contributes to ``benchmarks.put_get``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import Batch


@dataclass
class BenchBackend:
    """One backend in the benchmark: how to open a client, and optionally its raw API.

    ``raw`` receives the batch and the repeat count and returns (put seconds, get seconds) lists
    measured through the backend's own API, without dataplane in between.
    """

    name: str
    url: str
    requires: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    raw: Callable[[Batch, int], tuple[list[float], list[float]]] | None = None
    # URL and options another process uses to reach the store this client is attached to; None: the
    # backend is in-process only, so --readers does not apply.
    reader_url: Callable[[Any], tuple[str, dict[str, Any]]] | None = None

    def missing(self) -> list[str]:
        import importlib.util

        return [m for m in self.requires if importlib.util.find_spec(m) is None]
