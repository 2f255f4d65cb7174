"""The backends ``benchmarks.put_get`` measures: how to open each, and its raw API as the baseline."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workload import Batch

__all__ = ["PUT_FROM", "BenchBackend", "RawTimes", "all_backends"]

PUT_FROM = {
    "tensors": "ordinary tensors (torch.empty memory)",
    "empty": "tensors built in client.empty() memory (sent with no copy)",
}


@dataclass
class RawTimes:
    """Seconds of the backend's own API on the batch, per repetition: ``get``, and ``put`` for each
    ``put_from`` the backend has (:data:`PUT_FROM`): from ordinary tensors with whatever copy a raw
    user must make first ("tensors"), from memory the raw API already registered ("empty")."""

    get: list[float]
    put: dict[str, list[float]]


@dataclass
class BenchBackend:
    """One backend in the benchmark: how to open a client, and optionally its raw API.

    ``put_from``: the put paths measured, each a row of the table (:data:`PUT_FROM`); a path
    exists where ``client.empty()`` hands out memory a put sends without a copy. ``paths`` says in
    one sentence what the backend's rows compare (printed under the table).

    ``raw`` receives the batch, the repeat count, the benchmark's client of this backend and a
    warm-up count (untimed rounds first), and returns :class:`RawTimes` measured through the
    backend's own API, without dataplane in between (against the same deployment as the client,
    where that applies).
    """

    name: str
    url: str
    requires: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    put_from: tuple[str, ...] = ("tensors",)
    paths: str = ""
    raw: Callable[[Batch, int, Any, int], RawTimes] | None = None
    # URL and options another process uses to reach the store this client is attached to; None: the
    # backend is in-process only, so --readers does not apply.
    reader_url: Callable[[Any], tuple[str, dict[str, Any]]] | None = None
    # run before the benchmark closes its client (e.g. to close raw clients of the same deployment)
    before_close: Callable[[], None] | None = None
    # starts services the backend will use, early and on a thread (they mostly wait while they boot);
    # returns extra connect options and a cleanup run after the client is closed
    prepare: Callable[[], tuple[dict[str, Any], Callable[[], None]]] | None = None

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def all_backends() -> list[BenchBackend]:
    """Every backend, in the order measured: memory, then the direct Mooncake path (its teardown
    overlaps TransferQueue's start-up), then TransferQueue."""
    out = [
        BenchBackend(
            name="memory",
            url="memory://",
            paths="a put copies the tensors once into the store's memory, a get copies them out once; "
            "client.empty() is torch.empty (no copy-free path) and there is no raw API: memcpy is the ceiling",
        )
    ]
    for module in ("benchmarks.backends_mooncake", "benchmarks.backends_tq"):
        out += importlib.import_module(module).BACKENDS
    return out
