"""Puts of the Mooncake store: the schema check against every writer's puts (or, for a field this
client has put before, a query whether that put is still there), then one batch write of the data
objects and the index object (see :mod:`._index` for the layout)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane._host.hostcopy import copy_bytes
from dataplane.adapters.mooncake._index import (
    PACKED,
    PutIndex,
    data_key,
    encode_index,
    index_object_bytes,
    make_index,
    new_put_id,
    pack_layout,
    packed_key,
    partition_prefix,
)
from dataplane.adapters.mooncake._partitions import HINT_KEY, READ_KEY, PartitionCache, _Part
from dataplane.codec.jagged import round_up
from dataplane.codec.wire import Column
from dataplane.schema import FieldSchema, check_compatible
from dataplane.storage import PendingPut

__all__ = ["Puts"]

# A put of at most this many bytes with two or more non-empty fields is packed into one data object
# (see _index): a rollout put on its own is ~50 KB in 8 fields, and every object costs Mooncake a
# fixed time. A get of some fields of it reads the whole object: at this size that costs less than
# another object would.
_PACK_MAX_BYTES = 1 << 20


def _shared_offsets(offsets: np.ndarray, known: Iterable[np.ndarray]) -> np.ndarray:
    """``offsets``, or an equal array of ``known``: fields with the same row lengths (each built as
    its own nested tensor, say) then store their offsets once, and a get plans their reads once."""
    for other in known:
        if len(other) == len(offsets) and other[-1] == offsets[-1] and np.array_equal(other, offsets):
            return other
    return offsets


@dataclass
class _PlannedPut:
    """A put ready to write: its objects (keys, source pointers, sizes) and its index."""

    put_id: str
    keys: Sequence[str]
    tags: Sequence[Mapping[str, Any]] | None
    entries: dict[str, tuple[FieldSchema, int, np.ndarray | None]]
    obj_keys: list[str] = dataclasses.field(default_factory=list)
    ptrs: list[int] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)
    hold: list[torch.Tensor] = dataclasses.field(default_factory=list)  # sources stay alive until written
    body: bytes = b""
    index_key: str = ""
    index: PutIndex | None = None


class Puts(PartitionCache):
    """The put half of :class:`~dataplane.adapters.mooncake._store.MooncakeStore`."""

    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        *,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        return self.begin_put(partition_id, timeout_s=timeout_s).write(keys, columns, tags)

    def begin_put(self, partition_id: str, *, timeout_s: float) -> PendingPut:
        """Ask the master for what the schema check needs before the client has checked the put (the
        master answers while the client validates and encodes).

        The schema check needs every writer's puts: a listing of the master's keys, which costs ~1 us
        per key in the master, anyone's. Where this client has put into the partition before, it asks
        instead whether its own newest puts of each field are still there (``/batch_query_keys``: a
        few keys, whatever the master holds). A put of those fields with the same schemas then needs
        no listing: a put that is still there passed the check when it was written, and a clear that
        emptied the field since would have removed it (a put racing that first one with another
        schema already lost, see :class:`PartitionState`). Anything else takes the listing."""
        deadline = time.monotonic() + timeout_s
        with self._parts_lock:
            part = self._parts.get(partition_id)
        mine: dict[str, tuple[str, FieldSchema]] = {}
        if part is not None:
            with part.lock:
                mine = dict(part.mine)
        if mine:
            existing = self.admin.start_existing(sorted({key for key, _ in mine.values()}), self._time_left(deadline))
            return _MooncakePut(self, partition_id, deadline, mine=mine, existing=existing, listing=None)
        return _MooncakePut(
            self, partition_id, deadline, mine=mine, existing=None, listing=self._start_listing(deadline)
        )

    def _put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        listing: Callable[[], list[str]] | None,
        deadline: float,
    ) -> dict[str, Any]:
        """Write the put, schema-checked against ``listing`` (None: already checked, see
        :meth:`begin_put`)."""
        planned = self._plan_put(partition_id, new_put_id(self.writer), keys, columns, tags)
        lines = None if listing is None else listing()
        part = self._part(partition_id)
        with part.lock:
            if lines is not None and columns:  # (a tag-only put has no schema to check)
                state = self._refresh(partition_id, part, lines, {}, deadline)
                for name, col in columns.items():
                    known = state.schema.get(name) or part.pending.get(name, (None, 0))[0]
                    if known is not None:
                        check_compatible(partition_id, name, known, col.schema)
            for name, col in columns.items():
                schema, count = part.pending.get(name, (col.schema, 0))
                part.pending[name] = (schema, count + 1)
        try:
            out = self._put_checked(part, partition_id, planned, deadline)
        finally:
            with part.lock:
                for name in columns:
                    schema, count = part.pending[name]
                    if count > 1:
                        part.pending[name] = (schema, count - 1)
                    else:
                        del part.pending[name]
        with part.lock:
            for name, col in columns.items():
                part.mine[name] = (planned.index_key, col.schema)
        return out

    def _plan_put(
        self,
        partition_id: str,
        put_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
    ) -> _PlannedPut:
        """Object keys, source pointers and the index body of a put (no I/O)."""
        head = partition_prefix(self.ns, partition_id)
        entries: dict[str, tuple[FieldSchema, int, np.ndarray | None]] = {}
        plan = _PlannedPut(put_id, keys, tags, entries)
        arrays: dict[int, np.ndarray] = {}  # fields sharing one offsets tensor share one array (and index bytes)
        sources: dict[str, torch.Tensor] = {}
        for name, col in columns.items():
            values = col.values if col.values.is_contiguous() else col.values.contiguous()
            offsets = None
            if col.offsets is not None:
                offsets = arrays.get(id(col.offsets))
                if offsets is None:
                    offsets = arrays[id(col.offsets)] = _shared_offsets(
                        col.offsets.numpy().astype(np.int64, copy=False), arrays.values()
                    )
            entries[name] = (col.schema, values.nbytes, offsets)
            if values.nbytes:  # Mooncake cannot store 0 bytes: no object, the index says 0
                sources[name] = values
        packed = pack_layout({name: n for name, (_, n, _) in entries.items()}) if len(sources) > 1 else None
        pad = self._pad
        if packed is not None and packed[1] <= _PACK_MAX_BYTES:  # the object, alignment included
            at, total = packed
            buf = self.pool.empty(round_up(total, pad))
            for name, values in sources.items():
                copy_bytes(buf[at[name] : at[name] + values.nbytes], values)
            sources = {PACKED: buf}
        else:
            packed = None
        for name, values in sources.items():
            nbytes, ptr = values.nbytes, values.data_ptr()
            stored = round_up(nbytes, pad)  # the padding is whatever lies after the values
            if self._stage_puts and not self.handle.reaches(ptr, stored):
                values = self._staged(values, nbytes, stored)
                ptr = values.data_ptr()
            plan.hold.append(values)
            plan.obj_keys.append(packed_key(head, put_id) if packed else data_key(head, put_id, name))
            plan.ptrs.append(ptr)
            plan.sizes.append(stored)
        plan.body = encode_index(keys, entries, tags, packed=packed, pad=pad)
        plan.index_key = f"{head}i/{put_id}.{len(plan.body)}"
        plan.index = make_index(plan.index_key, put_id, keys, entries, tags, packed, pad)
        return plan

    def _put_checked(self, part: _Part, partition_id: str, plan: _PlannedPut, deadline: float) -> dict[str, Any]:
        index_ptr, index_buf = self._sendable_bytes(plan.body)
        try:
            self._write(
                [*plan.obj_keys, plan.index_key],
                [*plan.ptrs, index_ptr],
                [*plan.sizes, index_object_bytes(len(plan.body))],
                partition_id,
                deadline,
            )
        finally:
            self._unstage(index_buf)
        plan.hold.clear()
        assert plan.index is not None
        with part.lock:
            part.known[plan.put_id] = plan.index
        sizes = {name: nbytes for name, (_, nbytes, _) in plan.entries.items()}
        keys = plan.keys
        return {
            HINT_KEY: {plan.index_key: plan.body},
            READ_KEY: [plan.index_key, len(keys), keys[0], keys[-1], sizes, plan.index.packed, plan.index.pad],
        }

    def _staged(self, values: torch.Tensor, nbytes: int, room: int) -> torch.Tensor:
        """Contiguous ``values`` copied into a pool buffer of ``room`` bytes, for a client that sends only
        memory it registered (RDMA) or shares (shared memory). Everything else goes out as it is: any
        memory over TCP, and this client's own memory (from :meth:`empty`, or from a get: a
        write-back) where it holds the object's padding too."""
        staged = self.pool.empty(room)
        copy_bytes(staged[:nbytes], values)  # not torch's copy_: its spinning threads would slow the send that follows
        return staged

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.pool.tensor(shape, dtype) if self._stage_puts else torch.empty(shape, dtype=dtype)


class _MooncakePut(PendingPut):
    """A put whose schema-check question (a listing, or a query whether this client's own latest
    puts of its fields are still there) is already on its way to the master (see
    :meth:`Puts.begin_put`)."""

    __slots__ = ("_deadline", "_existing", "_listing", "_mine", "_partition_id", "_store")

    def __init__(
        self,
        store: Puts,
        partition_id: str,
        deadline: float,
        *,
        mine: dict[str, tuple[str, FieldSchema]],
        existing: Callable[[], set[str] | None] | None,
        listing: Callable[[], list[str]] | None,
    ) -> None:
        self._store = store
        self._partition_id = partition_id
        self._deadline = deadline
        self._mine = mine
        self._existing = existing
        self._listing = listing

    def write(
        self, keys: Sequence[str], columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]] | None
    ) -> dict[str, Any]:
        listing = self._listing
        if self._existing is not None:
            alive = self._existing() or set()
            for name, col in columns.items():
                key, schema = self._mine.get(name, ("", None))
                if schema != col.schema or key not in alive:
                    listing = self._store._start_listing(self._deadline)
                    break
        return self._store._put(self._partition_id, keys, columns, tags, listing, self._deadline)
