"""The Mooncake :class:`~dataplane.storage.KVStore`: puts, gets, clears and listings over the layout of
:mod:`._index` through a guarded :class:`~._handle.StoreHandle`.

Round trips. A put: one listing of the master's keys (schema check against every writer's puts),
or, into a partition this client has put the same fields into before, one query whether its own
latest puts of them are still there (see :meth:`._put.Puts.begin_put`); then one
``batch_upsert_from`` carrying the data objects and the index object together. A get: one
listing, then one ``batch_get_into`` (or ``get_into_ranges``) for the data, then one query whether
the index objects of the puts read are still there (``/batch_query_keys``, a few keys however many
the master holds; a listing where the rows came from so many puts that it costs less): what was
read is trusted only then (a clear removes index objects before data
objects, and a clear may free an object mid-read for another put to fill). Index objects are
immutable and cached, so only puts this process has not seen cost one more read (and a query after
it), and a get by the meta a put returned does not even pay that
(the meta carries the put's index in ``extra_info``; it is used only while the listing still shows
that index, so a stale hint never returns stale data). When the get asks for exactly the meta's
rows in order (the usual RL read), the read is issued first, from the meta's read hint alone, while
the index is decoded and checked against the hint (beside the read where the client has a helper
thread), and the listing after the read is its only one; what was read is kept when that listing
shows that index as the partition's only one, and the rows are not even folded into the per-row
state (see :meth:`._get.Gets.begin_get`).
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Sequence

from dataplane.adapters.mooncake._claims import Claims
from dataplane.adapters.mooncake._get import Gets
from dataplane.adapters.mooncake._index import part_token, partition_of_token
from dataplane.adapters.mooncake._partitions import HINT_KEY, READ_KEY
from dataplane.adapters.mooncake._put import Puts
from dataplane.client import Listing
from dataplane.meta import RowInfo

__all__ = ["HINT_KEY", "READ_KEY", "MooncakeStore"]


class MooncakeStore(Puts, Gets, Claims):
    """The Mooncake store (see the module docstring): the partition cache it shares with its puts, gets,
    clears and claims (:class:`._claims.Claims`, a :class:`._clear.Clears`) lives in
    :class:`._partitions.PartitionCache`."""

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        deadline = time.monotonic() + timeout_s
        lines = self._listing(deadline)
        if partition_id is not None:
            partition_ids = [partition_id]
        else:
            head = f"{self.ns}/"
            tokens = {ln[len(head) :].split("/", 1)[0] for ln in lines if ln.startswith(head) and "/i/" in ln}
            partition_ids = sorted(partition_of_token(t) for t in tokens if part_token(partition_of_token(t)) == t)
        out: Listing = {}
        for part_id in partition_ids:
            part = self._part(part_id)
            with part.lock:
                rows = self._refresh(part_id, part, lines, {}, deadline).listing()
            if rows:
                out[part_id] = rows
        return out

    def describe(self, partition_id: str, keys: Sequence[str], *, timeout_s: float) -> builtins.list[RowInfo | None]:
        """What each of ``keys`` holds (see :meth:`~dataplane.storage.KVStore.describe`), from the
        partition's index objects: one listing of the master's keys (as a get of keys this client
        does not know takes), the partition's index objects it has not read yet, and its folded
        state. It reads no data object and folds no other partition."""
        deadline = time.monotonic() + timeout_s
        lines = self._listing(deadline)
        part = self._part(partition_id)
        with part.lock:
            found = self._refresh(partition_id, part, lines, {}, deadline).describe(keys)
        self._forget(partition_id, part)  # only where it holds nothing (no put ever listed)
        return [None if x is None else RowInfo(*x) for x in found]

    def close(self) -> None:
        if self.deployment is not None and self.handle.shm is None:
            # its 1-2 s unmount overlaps ours (a shared-memory client must detach from it first)
            self.deployment.server.request_stop()
        self._stages = []
        try:
            self.pool.close()
            self.handle.close()
        finally:
            self.admin.close()
