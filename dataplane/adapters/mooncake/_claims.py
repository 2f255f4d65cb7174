"""Consumption by task on ``mooncake://`` (``docs/claims.md``): one claim marker per (row, task).

A row is claimed for a task by writing its marker ``{ns}/{part}/c/{task}/{row id}`` put-if-absent,
holding a token unique to the claim call, and reading it back: Mooncake keeps the value already
there (a second put of a key, or one while the first is in flight, reports success and writes
nothing), so whoever's token the read finds won, in every process of the deployment. A read while
the winning put is in flight answers -703 (not ready): it is read again. The row id is the put id
the row's key was first put by since it was last cleared plus a digest of the key
(:meth:`._fold.PartitionState.row_ids`): a key cleared and put again is a new row, unclaimed, and a
marker written for a row already cleared claims nothing. Markers are index-like small objects:
hard-pinned (never evicted), padded to a page like index objects, in the store server's segment
(clients lend none), removed with their rows by a clear, and by ``reset_consumption``.

Round trips: a claim lists the master's keys once (index objects and this task's markers), reads
index objects it has not folded yet, writes and reads back one marker per row it tries (one batch
call each way), and lists once more to hand out only rows that a clear did not remove meanwhile.
"""

from __future__ import annotations

import builtins
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dataplane.adapters.mooncake._clear import Clears, _literal
from dataplane.adapters.mooncake._handle import NOT_READY, TRANSIENT, error_for
from dataplane.adapters.mooncake._index import (
    claims_prefix,
    finished_key,
    index_and_claim_lines,
    index_object_bytes,
)
from dataplane.claims import ConsumptionStatus, count_status, tags_match
from dataplane.storage import ClaimedRow

__all__ = ["Claims"]

_MARKERS_PER_CALL = 1024  # claim markers written and read back per call: 2 pages each of shared memory (8 MiB)

_Row = tuple[str, frozenset[str], dict[str, Any], str]  # key, fields, tags, row id


class Claims(Clears):
    """The claim part of :class:`~dataplane.adapters.mooncake._store.MooncakeStore`."""

    def _rows_and_claims(
        self, partition_id: str, task_name: str, deadline: float
    ) -> tuple[builtins.list[_Row], set[str], bool]:
        """The partition's rows in first-put order, the ids of the rows ``task_name`` claimed, and
        whether the partition is marked finished: from one listing of the master's keys (the
        namespace's index objects, this task's markers, the finished mark)."""
        head = claims_prefix(self.ns, partition_id, task_name)
        mark = finished_key(self.ns, partition_id)
        keep = index_and_claim_lines(self.ns, head, mark)
        lines = self.admin.start_all_keys(self._time_left(deadline), keep)()
        claimed = {ln[len(head) :] for ln in lines if ln.startswith(head)}
        part = self._part(partition_id)
        with part.lock:
            state = self._refresh(partition_id, part, lines, {}, deadline)
            keys = builtins.list(state.rows)
            found = state.describe(keys)
            ids = state.row_ids(keys)
        self._forget(partition_id, part)
        rows = [(k, r[0], r[1], i) for k, r, i in zip(keys, found, ids, strict=True) if r is not None and i is not None]
        return rows, claimed, mark in lines

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
        deadline = time.monotonic() + timeout_s
        rows, claimed, _ = self._rows_and_claims(partition_id, task_name, deadline)
        need = frozenset(fields)
        todo = [(k, t, i) for k, have, t, i in rows if i not in claimed and need <= have and tags_match(t, tag_filter)]
        head = claims_prefix(self.ns, partition_id, task_name)
        won: builtins.list[tuple[str, dict[str, Any], str]] = []
        at = 0
        while len(won) < n and at < len(todo):  # markers others won move us on to the next rows
            batch = todo[at : at + min(n - len(won), _MARKERS_PER_CALL)]  # bounded shared memory per call
            at += len(batch)
            mine = self._take([head + i for _, _, i in batch], deadline)
            won += [row for row, ok in zip(batch, mine, strict=True) if ok]
        if not won:
            return []
        after, _, _ = self._rows_and_claims(partition_id, task_name, deadline)
        live = {i for _, _, _, i in after}  # a row cleared while it was claimed is not handed out
        return [(k, t) for k, t, i in won if i in live]

    def _take(self, markers: Sequence[str], deadline: float) -> builtins.list[bool]:
        """Write ``markers`` put-if-absent with a token of this call, read them back; per marker,
        whether it holds our token (we claimed its row)."""
        token = f"{self.writer}:{uuid.uuid4().hex}".encode()
        room = index_object_bytes(len(token))  # a page, like an index object (see _index.OBJECT_ALIGN)
        k = len(markers)
        buf = self.pool.empty(2 * k * room)  # k tokens to send, then k pages to read into
        raw = buf.numpy()
        base = int(raw.ctypes.data)
        mine = np.frombuffer(token, dtype=np.uint8)
        for j in range(k):
            raw[j * room : j * room + len(token)] = mine
        codes = self.handle.put_from_if_absent(markers, [base + j * room for j in range(k)], [room] * k)
        failed = [c for c in codes if c != 0 and c not in TRANSIENT]
        out = [False] * k
        todo = [j for j, c in enumerate(codes) if c == 0 or c in TRANSIENT]  # a transient failure may have written
        attempt = 0
        while todo:
            got = self.handle.get_into(
                [markers[j] for j in todo], [base + (k + j) * room for j in todo], [room] * len(todo)
            )
            again = []
            for j, code in zip(todo, got, strict=True):
                if code >= len(token):
                    at = (k + j) * room
                    out[j] = bytes(raw[at : at + len(token)]) == token
                elif code == NOT_READY or code in TRANSIENT:  # the winner's put is in flight
                    again.append(j)
                # else: removed meanwhile (a clear or a reset) or never written: not ours
            if not again or time.monotonic() >= deadline:
                break
            todo = again
            time.sleep(min(0.002 * 2**attempt, 0.05))
            attempt += 1
        if failed and not any(out):
            raise error_for(failed[0], f"writing {len(markers)} claim markers")
        del buf  # kept alive until the reads are done
        return out

    def consumption(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        tag_filter: Mapping[str, Any] | None,
        *,
        timeout_s: float,
    ) -> ConsumptionStatus:
        deadline = time.monotonic() + timeout_s
        rows, claimed, finished = self._rows_and_claims(partition_id, task_name, deadline)
        return count_status(
            partition_id,
            task_name,
            ((i in claimed, have, t) for _, have, t, i in rows),
            fields,
            tag_filter,
            finished=finished,
        )

    def reset_claims(self, partition_id: str, task_name: str | None, *, timeout_s: float) -> None:
        self.handle.check()
        self.handle.remove_regex("^" + _literal(claims_prefix(self.ns, partition_id, task_name)))

    def mark_finished(self, partition_id: str, finished: bool, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        key = finished_key(self.ns, partition_id)
        if not finished:
            self.handle.check()
            self._remove([key])
            return
        ptr, held = self._sendable_bytes(b"1")
        try:
            self._write([key], [ptr], [index_object_bytes(1)], partition_id, deadline)
        finally:
            self._unstage(held)
