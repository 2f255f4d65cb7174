"""Count what a process moves through the data plane: bytes put and read, and seconds spent in calls.

Wrap the client once; every process of a job (driver, rollout, trainer ranks) keeps its own meter,
and the driver adds them up::

    meter = TrafficMeter()
    client = meter.wrap(dataplane.connect(url))
    ...
    meter.totals()   # {"bytes_put": ..., "bytes_get": ..., "seconds": ..., "calls": ...}

>>> import dataplane, torch
>>> meter = TrafficMeter()
>>> with meter.wrap(dataplane.connect()) as client:
...     meta = client.kv_batch_put(["a"], {"x": torch.zeros(1, 4)}, partition_id="p")
...     _ = client.kv_batch_get(meta, select_fields="x")
>>> meter.totals()["bytes_put"], meter.totals()["bytes_get"], meter.totals()["calls"]
(16, 16, 2)
"""

from __future__ import annotations

import threading

from dataplane import DataPlaneClient
from dataplane.observability import CallEvent, ObservedClient

__all__ = ["TRAINER_TIMES", "TrafficMeter", "add_totals"]

#: What a trainer rank's ``traffic()`` adds to its data-plane totals: seconds of its step calls spent
#: moving data (reads, write-backs, shipped rows to the device) and the rest of them (compute).
TRAINER_TIMES = ("trainer_data_seconds", "trainer_compute_seconds")


class TrafficMeter:
    """Running totals of the calls of the clients it wraps (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {"bytes_put": 0, "bytes_get": 0, "seconds": 0.0, "calls": 0}

    def wrap(self, client: DataPlaneClient) -> ObservedClient:
        """``client`` wrapped so that each of its calls is counted here (closing the wrapper closes it)."""
        return ObservedClient(client, callback=self.record)

    def reconnect(self, current: DataPlaneClient | None, url: str | None) -> ObservedClient | None:
        """Close ``current`` (a client this process opened, or None) and return a counted client of
        ``url`` (a ``client.url``), or None when ``url`` is None."""
        if current is not None:
            current.close()
        if url is None:
            return None
        import dataplane

        return self.wrap(dataplane.connect(url))

    def record(self, event: CallEvent) -> None:
        """Count one finished call (the :class:`~dataplane.observability.ObservedClient` callback)."""
        with self._lock:
            self._totals["calls"] += 1
            self._totals["seconds"] += event.seconds
            if event.op == "kv_batch_put":
                self._totals["bytes_put"] += event.bytes
            elif event.op == "kv_batch_get":
                self._totals["bytes_get"] += event.bytes

    def reset(self) -> None:
        """Start the totals over (the wrapped clients keep counting here).

        >>> meter = TrafficMeter()
        >>> meter.record(CallEvent(op="kv_batch_get", partition_id="p", n_keys=1, n_fields=1, bytes=8, seconds=0.5, status="ok"))
        >>> meter.reset()
        >>> meter.totals()["bytes_get"], meter.totals()["calls"]
        (0, 0)
        """
        with self._lock:
            self._totals = {"bytes_put": 0, "bytes_get": 0, "seconds": 0.0, "calls": 0}

    def totals(self) -> dict[str, float]:
        """``bytes_put``, ``bytes_get`` (tensor bytes), ``seconds`` (summed over calls) and ``calls``."""
        with self._lock:
            return dict(self._totals)


def add_totals(*totals: dict[str, float], sign: int = 1) -> dict[str, float]:
    """Key-wise sum of :meth:`TrafficMeter.totals` (of several processes); ``sign=-1`` subtracts all
    but the first (the traffic between two readings). Also sums the trainer ranks' step-call times
    (``trainer_data_seconds``, ``trainer_compute_seconds``: 0 where a process has none).

    >>> add_totals({"seconds": 1.0, "trainer_data_seconds": 0.5}, {"seconds": 0.25})["trainer_data_seconds"]
    0.5
    """
    out: dict[str, float] = {"bytes_put": 0, "bytes_get": 0, "seconds": 0.0, "calls": 0}
    out.update({k: 0.0 for k in TRAINER_TIMES})
    for i, t in enumerate(totals):
        for k in out:
            out[k] += t.get(k, 0) * (1 if i == 0 else sign)
    return out
