"""Per-call observability of :meth:`~dataplane.worker.DataPlaneWorkerMixin.fetch` and
:meth:`~dataplane.worker.DataPlaneWorkerMixin.write_back`.

Every fetch leaves a :class:`FetchStats` on the worker (``last_fetch_stats``). Observers added with
:func:`add_stats_observer` also receive it, and a :class:`WriteBackStats` for every write-back a rank
makes, from the calling thread: that is how :mod:`dataplane.metrics` times the workers of a process.
Without an observer the mixin pays one empty loop per call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeAlias

__all__ = ["FetchStats", "StatsObserver", "WriteBackStats", "add_stats_observer", "notify_stats_observers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchStats:
    """What one :meth:`DataPlaneWorkerMixin.fetch` moved, on this rank.

    Attributes:
        policy: the policy that ran (``auto`` resolved).
        role: ``reader`` (independent), ``leader`` or ``sibling``.
        group_size: ranks in the replica group (1 without one).
        rows: rows of the shard.
        fields: fields fetched.
        store_bytes: tensor bytes this rank read from the store, in wire form (values + offsets;
            object columns are not counted, as in :class:`~dataplane.observability.ObservedClient`).
        broadcast_bytes: bytes this rank sent (leader) or received (sibling) through the group,
            descriptor included.
        read_s: seconds reading from the store.
        stage_s: seconds copying the wire form into the flat buffers (leader).
        wait_s: seconds a sibling waited for the leader's descriptor (the leader's read).
        broadcast_s: seconds of descriptor, agreement and buffer broadcasts.
        materialize_s: seconds turning the wire form into the returned TensorDict.
        total_s: seconds of the whole call.
        pad_width: width of the padded jagged fields (``layout="padded"``), else None.

    >>> s = FetchStats(policy="independent", role="reader", group_size=1, rows=2, fields=("x",))
    >>> FetchStats.from_dict(s.to_dict()) == s
    True
    """

    policy: Literal["independent", "leader_broadcast"]
    role: Literal["reader", "leader", "sibling"]
    group_size: int
    rows: int
    fields: tuple[str, ...]
    store_bytes: int = 0
    broadcast_bytes: int = 0
    read_s: float = 0.0
    stage_s: float = 0.0
    wait_s: float = 0.0
    broadcast_s: float = 0.0
    materialize_s: float = 0.0
    total_s: float = 0.0
    pad_width: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fields"] = list(self.fields)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FetchStats:
        return cls(**{**d, "fields": tuple(d["fields"])})


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteBackStats:
    """One :meth:`DataPlaneWorkerMixin.write_back` that wrote (ranks that are not the write-back
    leader return at once and report nothing).

    Attributes:
        rows: rows written.
        fields: fields written.
        seconds: the whole call: checks, packing, copies to the host and the put.
    """

    rows: int
    fields: tuple[str, ...]
    seconds: float


StatsObserver: TypeAlias = Callable[["FetchStats | WriteBackStats"], None]
_observers: tuple[StatsObserver, ...] = ()  # replaced whole (never mutated): the mixin reads it unlocked
_observers_lock = threading.Lock()


def add_stats_observer(observer: StatsObserver) -> Callable[[], None]:
    """Call ``observer`` with the stats of every fetch and write-back of every worker in this process.

    Returns the function that removes it (idempotent). The observer runs on the worker's thread,
    after the call; its exceptions are logged, never raised into the worker.

    >>> seen = []
    >>> remove = add_stats_observer(seen.append)
    >>> notify_stats_observers(WriteBackStats(rows=2, fields=("lp",), seconds=0.5))
    >>> remove()
    >>> notify_stats_observers(WriteBackStats(rows=1, fields=("lp",), seconds=0.5))
    >>> [s.rows for s in seen]
    [2]
    """
    global _observers
    with _observers_lock:
        _observers = (*_observers, observer)

    removed = False

    def remove() -> None:
        nonlocal removed
        global _observers
        with _observers_lock:
            at = next((i for i, o in enumerate(_observers) if o is observer), None)
            if at is not None and not removed:  # this registration only (an observer may be added twice)
                _observers = _observers[:at] + _observers[at + 1 :]
            removed = True

    return remove


def notify_stats_observers(stats: FetchStats | WriteBackStats) -> None:
    """Send ``stats`` to every observer (what the mixin calls after each fetch and write-back)."""
    for observer in _observers:
        try:
            observer(stats)
        except Exception:
            log.exception("dataplane: a worker stats observer failed")
