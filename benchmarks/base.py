"""What a backend contributes to ``benchmarks.put_get``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import Batch


@contextlib.contextmanager
def timing_calls(obj: Any, name: str) -> Iterator[list[float]]:
    """Seconds of every call of ``obj.name`` made inside the block (appended as each returns or
    raises); the method is put back on the way out."""
    method = getattr(obj, name)
    own = name in vars(obj)  # set on the instance (else the class's method shows through again after)
    seconds: list[float] = []

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(*a, **k)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    try:
        yield seconds
    finally:
        if own:
            setattr(obj, name, method)
        else:
            delattr(obj, name)


@dataclass
class BenchBackend:
    """One backend in the benchmark: how to open a client, and optionally its raw API.

    ``raw`` receives the batch, the repeat count and the benchmark's client of this backend, and
    returns (put seconds, get seconds) lists measured through the backend's own API, without
    dataplane in between (against the same deployment as the client, where that applies).
    """

    name: str
    url: str
    requires: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    raw: Callable[[Batch, int, Any], tuple[list[float], list[float]]] | None = None
    # URL and options another process uses to reach the store this client is attached to; None: the
    # backend is in-process only, so --readers does not apply.
    reader_url: Callable[[Any], tuple[str, dict[str, Any]]] | None = None
    # run before the benchmark closes its client (e.g. to close raw clients of the same deployment)
    before_close: Callable[[], None] | None = None
    # starts services the backend will use, early and on a thread (they mostly wait while they boot);
    # returns extra connect options and a cleanup run after the client is closed
    prepare: Callable[[], tuple[dict[str, Any], Callable[[], None]]] | None = None

    def missing(self) -> list[str]:
        import importlib.util

        return [m for m in self.requires if importlib.util.find_spec(m) is None]
