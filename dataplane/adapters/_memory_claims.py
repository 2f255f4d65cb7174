"""Consumption by task on ``memory://`` (part of :mod:`dataplane.adapters.memory`; ``docs/claims.md``).

The claims live in the row table, one set of slots per task in each partition, changed under the
store's one lock: a claim is atomic against every other call of the process. A cleared slot leaves
every task's set (``_Partition.forget``), so a key put again is a new, unclaimed row."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dataplane._host.slots import described
from dataplane.claims import ConsumptionStatus, count_status, tags_match
from dataplane.storage import ClaimedRow

__all__ = ["MemoryClaims"]


class MemoryClaims:
    """The claim half of :class:`~dataplane.adapters.memory.MemoryStore`."""

    _lock: threading.Lock
    _parts: dict[str, Any]  # partition -> memory's _Partition (rows, cols, tagged, claims, holding())
    _finished: set[str]

    def _acquire(self, timeout_s: float) -> None:
        """Take the store's lock within ``timeout_s`` (the store's own method)."""
        raise NotImplementedError

    def claim(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        n: int,
        tag_filter: Mapping[str, Any] | None,
        *,
        timeout_s: float,
    ) -> builtins.list[ClaimedRow]:
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            if part is None:
                return []
            keys = builtins.list(part.rows)
            slots = np.fromiter(part.rows.values(), np.int64, len(keys))
            taken = part.claims.setdefault(task_name, set())
            ready = part.holding(slots, fields) & ~np.isin(slots, np.fromiter(taken, np.int64, len(taken)))
            at = np.flatnonzero(ready)
            if tag_filter is None:
                at = at[:n]
            found = described(slots[at], {}, part.tagged)
            out: builtins.list[ClaimedRow] = []
            for i, row in zip(at.tolist(), found, strict=True):
                assert row is not None
                if len(out) < n and tags_match(row[1], tag_filter):
                    out.append((keys[i], row[1]))
                    taken.add(int(slots[i]))
            return out
        finally:
            self._lock.release()

    def consumption(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        tag_filter: Mapping[str, Any] | None,
        *,
        timeout_s: float,
    ) -> ConsumptionStatus:
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            rows: builtins.list[tuple[bool, frozenset[str], dict[str, Any]]] = []
            if part is not None:
                slots = np.fromiter(part.rows.values(), np.int64, len(part.rows))
                taken = part.claims.get(task_name, set())
                found = described(slots, {f: c[0] for f, c in part.cols.items()}, part.tagged)
                rows = [(s in taken, *r) for s, r in zip(slots.tolist(), found, strict=True) if r is not None]
            finished = partition_id in self._finished
        finally:
            self._lock.release()
        return count_status(partition_id, task_name, rows, fields, tag_filter, finished=finished)

    def reset_claims(self, partition_id: str, task_name: str | None, *, timeout_s: float) -> None:
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            if part is not None:
                if task_name is None:
                    part.claims.clear()
                else:
                    part.claims.pop(task_name, None)
        finally:
            self._lock.release()

    def mark_finished(self, partition_id: str, finished: bool, *, timeout_s: float) -> None:
        self._acquire(timeout_s)
        try:
            if finished:
                self._finished.add(partition_id)
            else:
                self._finished.discard(partition_id)
        finally:
            self._lock.release()
