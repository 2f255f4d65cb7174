"""The state every operation of the Mooncake store shares: the partition cache (the index objects
this client has read, folded into per-row state), the master's answers (listings, queries) and the
object writes and removals that puts and clears both make."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane._host.bufpool import BufferPool
from dataplane.adapters.mooncake._fold import PartitionState, Resolved
from dataplane.adapters.mooncake._handle import (
    NOT_FOUND,
    NOT_READY,
    TRANSIENT,
    AdminClient,
    StoreHandle,
    code_name,
    error_for,
)
from dataplane.adapters.mooncake._index import (
    OBJECT_ALIGN,
    ListedPuts,
    PutIndex,
    decode_index,
    index_lines,
    index_object_bytes,
    index_prefix,
    is_index_key,
)
from dataplane.adapters.mooncake._read import Reader
from dataplane.client import Capabilities
from dataplane.errors import DataPlaneTimeout
from dataplane.schema import FieldSchema
from dataplane.storage import KVStore

__all__ = ["HINT_KEY", "READ_KEY", "PartitionCache"]

log = logging.getLogger(__name__)

HINT_KEY = "mooncake_index"  # meta.extra_info[HINT_KEY] = {index key: index bytes} of the put
# meta.extra_info[READ_KEY] = [index key, row count, first key, last key, {field: its bytes}, packed
# object bytes or 0, what objects are padded to (see OBJECT_ALIGN)]: enough to start reading a put's
# objects before its index is even decoded (checked against the index meanwhile)
READ_KEY = "mooncake_read"
_ATTEMPTS = 4
_STAGE_BYTES = 64 << 10  # staging buffer of index bodies (one of 4096 rows with a few fields fits)
# what the master's answer to a query costs per key it names, in keys it would list instead
_QUERY_COST = 8
_QUERY_MAX_KEYS = 4096  # names per query (its URL holds them all: ~70 bytes each; 5,000 were fine)


@dataclass
class _Part:
    lock: threading.Lock
    known: dict[str, PutIndex]
    state: PartitionState
    # schemas of this client's puts still being written: field -> (schema, count); a concurrent put
    # of the same new field from another thread of this process is checked against them
    pending: dict[str, tuple[FieldSchema, int]] = dataclasses.field(default_factory=dict)
    lines: ListedPuts = dataclasses.field(default_factory=ListedPuts)  # the index lines last listed
    # field -> (index key, schema) of this client's newest put holding it: while that index exists, a
    # put of the field with that schema needs no listing (see Puts.begin_put)
    mine: dict[str, tuple[str, FieldSchema]] = dataclasses.field(default_factory=dict)


class PartitionCache(KVStore):
    """What :class:`~dataplane.adapters.mooncake._store.MooncakeStore` is built on (see that module)."""

    def __init__(
        self,
        handle: StoreHandle,
        admin: AdminClient,
        *,
        ns: str,
        protocol: str,
        pool_bytes: int,
        writer: str,
    ) -> None:
        self.handle = handle
        self.admin = admin
        self.ns = ns
        self.writer = writer
        self._index_lines = index_lines(ns)  # listings keep only this namespace's index keys
        # puts are copied into the pool (see _sendable); TCP also reads into unregistered memory
        self._stage_puts = protocol != "tcp" or handle.shm is not None
        # data objects are padded where every source lies in this client's memory (see OBJECT_ALIGN)
        self._pad = OBJECT_ALIGN if self._stage_puts else 1
        if handle.shm is not None:
            self.pool = BufferPool(pool_bytes, min_bytes=1, alloc=handle.shm.alloc, on_drop=handle.shm.free)
        else:
            self.pool = BufferPool(
                pool_bytes,
                min_bytes=1 if self._stage_puts else 64 << 10,
                on_new=handle.register,
                on_drop=handle.unregister,
            )
        self.reader = Reader(handle, self.pool)
        self._stages: list[tuple[int, torch.Tensor]] = []  # see _sendable_bytes
        self.deployment: Any = None  # the LocalDeployment a mooncake://local client owns
        self.master_address = ""
        self.joined_by = ""  # what other processes pass to dataplane.connect() to share this store
        self.deployment_token = ""  # the master's (see _connect.deployment_token)
        self._parts: dict[str, _Part] = {}
        self._parts_lock = threading.Lock()
        self._caps = Capabilities(
            backend="mooncake", cross_process=True, cross_node=True, zero_copy=True, max_keys_per_call=1024
        )

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def url(self) -> str:
        """``mooncake://HOST:PORT?metrics_port=..&ns=..`` (plus ``real_client`` when this client
        reaches the store server through shared memory: that part holds on this host only)."""
        return self.joined_by

    @property
    def join_url(self) -> str:
        """The same as :attr:`url` (its earlier name)."""
        return self.joined_by

    @property
    def deployment_id(self) -> str:
        """``mooncake:TOKEN/NS``: TOKEN is written once per master by its first client and read back
        by every other (however it spells the master's host); NS is this client's namespace."""
        return f"mooncake:{self.deployment_token}/{self.ns}" if self.deployment_token else ""

    # -- partition state -------------------------------------------------------------------------
    def _part(self, partition_id: str) -> _Part:
        with self._parts_lock:
            part = self._parts.get(partition_id)
            if part is None:
                part = self._parts[partition_id] = _Part(threading.Lock(), {}, PartitionState())
            return part

    def _refresh(
        self, partition_id: str, part: _Part, lines: Sequence[str], hints: Mapping[str, PutIndex], deadline: float
    ) -> PartitionState:
        """Bring ``part`` to what the listing shows (call with ``part.lock`` held)."""
        listed = part.lines.update(lines, index_prefix(self.ns, partition_id))
        current = dict(part.known)
        for put_id in current.keys() - listed.keys():
            del current[put_id]
        unread = []
        for put_id in sorted(listed.keys() - current.keys()):
            key, size = listed[put_id]
            hinted = hints.get(key)  # names are unique and objects immutable: a listed hint is exact
            if hinted is not None:
                current[put_id] = hinted
            else:
                unread.append((put_id, key, size))
        if unread:
            current.update(self._read_indexes(unread, deadline))
        part.known = current
        part.state = part.state.refresh(current)
        return part.state

    def _read_indexes(self, unread: list[tuple[str, str, int]], deadline: float) -> dict[str, PutIndex]:
        """The index objects ``unread`` (put id, key, size) that are still there, decoded. What was
        read is decoded only once it is still there after the read (see :meth:`_still_there`): a
        clear may free an index object while it is read, and a put may fill the space, so a removed
        index can read as another one's bytes."""
        rooms = [index_object_bytes(size) for _, _, size in unread]
        buf = self.pool.empty(max(1, sum(rooms))).numpy()
        base, at, ptrs = int(buf.ctypes.data), 0, []
        for room in rooms:
            ptrs.append(base + at)
            at += room
        for attempt in range(_ATTEMPTS):
            codes = self.handle.get_into([k for _, k, _ in unread], ptrs, rooms)
            retry = [c for c in codes if c in TRANSIENT]
            if retry and attempt + 1 < _ATTEMPTS and time.monotonic() < deadline:
                time.sleep(0.05 * 2**attempt)
                continue
            break
        got = []
        for (put_id, key, size), ptr, room, code in zip(unread, ptrs, rooms, codes, strict=True):
            if code in (room, size):  # padded; or as dataplane wrote index objects before version 4
                got.append((put_id, key, ptr - base, size))
            elif code not in (NOT_FOUND, NOT_READY):  # removed after listing, or its put is in flight
                raise error_for(code, f"reading index object {key!r}")
        if not got:
            return {}
        there = self._existing([key for _, key, _, _ in got], deadline)
        return {
            put_id: decode_index(key, put_id, buf[lo : lo + size].tobytes())
            for put_id, key, lo, size in got
            if key in there
        }

    def _still_there(self, resolved: Mapping[str, Resolved], deadline: float) -> bool:
        """Whether the index of every put the rows of ``resolved`` were read from is still in the
        store, asked after the read. Only then are the bytes read trusted: a clear may free an object
        while it is read and a put may fill its space. Index objects go before the data objects they
        name (:meth:`_remove`), so an index still there after the read means its data objects were
        there throughout."""
        return self._start_still_there(resolved, deadline)()

    def _start_still_there(self, resolved: Mapping[str, Resolved], deadline: float) -> Callable[[], bool]:
        """:meth:`_still_there`, asked now; the returned function waits for the answer."""
        used = {p.key for res in resolved.values() for p in res.puts}
        existing = self._start_existing(sorted(used), deadline)
        return lambda: len(existing()) == len(used)

    def _existing(self, keys: Sequence[str], deadline: float) -> set[str]:
        """Which of ``keys`` the master holds now (:meth:`_start_existing`)."""
        return self._start_existing(keys, deadline)()

    def _start_existing(self, keys: Sequence[str], deadline: float) -> Callable[[], set[str]]:
        """Ask now which of ``keys`` the master holds; the returned function waits for the answer.
        Asked for those keys alone (``/batch_query_keys``, whatever else it holds), or found in a
        listing where that is cheaper (the master answers a query ~7x slower per key than a listing
        per key it lists) or the query fails."""
        if len(keys) <= _QUERY_MAX_KEYS and len(keys) * _QUERY_COST < self.admin.listed:
            query = self.admin.start_existing(keys, self._time_left(deadline))

            def queried() -> set[str]:
                found = query()
                return set(self._listing(deadline)).intersection(keys) if found is None else found.intersection(keys)

            return queried
        listing = self._start_listing(deadline)
        return lambda: set(listing()).intersection(keys)

    def _listing(self, deadline: float) -> list[str]:
        return self._start_listing(deadline)()

    def _start_listing(self, deadline: float) -> Callable[[], list[str]]:
        """Ask the master for its keys now; the returned function waits for the answer (so the
        caller's own work overlaps the master's, with no thread to contend for the GIL)."""
        return self.admin.start_all_keys(self._time_left(deadline), self._index_lines)

    def _time_left(self, deadline: float) -> float:
        """Seconds to ``deadline`` for a call to the master; raises when closed, forked or out of time."""
        self.handle.check()  # closed or forked: fail before any I/O
        left = deadline - time.monotonic()
        if left <= 0:
            raise DataPlaneTimeout("Mooncake call ran out of time; raise timeout_s")
        return left

    # -- writes and removals (puts and clears) ---------------------------------------------------
    def _sendable_bytes(self, body: bytes) -> tuple[int, Any]:
        """The address of ``body``, padded to an index object (:func:`index_object_bytes`), in memory a
        put can send, and what keeps it there: hand that to :meth:`_unstage` once written. A copy in a
        staging buffer kept for the next put (this is on every put's path), or in a new buffer when
        the body is larger or every staging buffer is in use. The padding is whatever the buffer held."""
        n = len(body)
        if not self._stage_puts:  # over TCP any memory goes: a buffer with room for the padding
            room = np.empty(index_object_bytes(n), dtype=np.uint8)
            room[:n] = np.frombuffer(body, dtype=np.uint8)
            return int(room.ctypes.data), room
        try:
            stage = self._stages.pop() if index_object_bytes(n) <= _STAGE_BYTES else None
        except IndexError:  # all in use (puts from several threads): one more
            stage = None
        if stage is None:
            buf = self.pool.empty(max(index_object_bytes(n), _STAGE_BYTES))
            stage = (buf.data_ptr(), buf)
        ctypes.memmove(stage[0], body, n)
        return stage[0], stage

    def _unstage(self, holder: Any) -> None:
        if type(holder) is tuple and holder[1].numel() == _STAGE_BYTES and len(self._stages) < 4:
            self._stages.append(holder)

    def _write(self, keys: list[str], ptrs: list[int], sizes: list[int], partition_id: str, deadline: float) -> None:
        """All-or-nothing hard-pinned upsert; retries transfer/RPC failures (a dead server's segment)."""
        for attempt in range(_ATTEMPTS):
            codes = self.handle.put_from(keys, ptrs, sizes)
            failed = [c for c in codes if c != 0]
            if not failed:
                return
            written = [k for k, c in zip(keys, codes, strict=True) if c == 0]
            if written:
                self._remove(written)  # no phantom objects
            if all(c in TRANSIENT for c in failed) and attempt + 1 < _ATTEMPTS and time.monotonic() < deadline:
                log.info("dataplane: Mooncake put failed with %s; retrying", code_name(failed[0]))
                time.sleep(0.1 * 2**attempt)
                continue
            total = sum(sizes)
            raise error_for(failed[0], f"put of {len(keys)} objects ({total} bytes) to partition {partition_id!r}")

    def _remove(self, keys: list[str]) -> None:
        """Force-remove ``keys``: index objects first, then (once the master has dropped them) the data
        objects. A reader trusts what it read only while the put's index is still there after the
        read (:meth:`_still_there`), so no data object may go while its index can still be found."""
        index = [k for k in keys if is_index_key(k)]
        data = [k for k in keys if not is_index_key(k)]
        bad = [c for group in (index, data) if group for c in self.handle.remove(group) if c not in (0, NOT_FOUND)]
        if bad:
            log.warning("dataplane: removing %d objects failed: %s", len(bad), code_name(bad[0]))
