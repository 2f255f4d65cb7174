"""The Mooncake :class:`~dataplane.store.KVStore`: puts, gets, clears and listings over the layout of
:mod:`dataplane.adapters._mc_index` through a guarded :class:`~dataplane.adapters._mc_handle.StoreHandle`.

Round trips. A put: one listing of the master's keys (schema check against every writer's puts),
or, into a partition this client has put the same fields into before, one query whether its own
latest puts of them are still there (see :meth:`MooncakeStore.put_started`); then one
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
state (see :meth:`MooncakeStore.get_started`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane._host.bufpool import BufferPool
from dataplane._host.hostcopy import copy_bytes
from dataplane._host.threads import usable_cpus
from dataplane.adapters._mc_handle import (
    NOT_FOUND,
    NOT_READY,
    TRANSIENT,
    AdminClient,
    StoreHandle,
    code_name,
    error_for,
)
from dataplane.adapters._mc_index import (
    OBJECT_ALIGN,
    PACKED,
    ListedPuts,
    PartitionState,
    PutIndex,
    Resolved,
    data_key,
    data_prefix,
    decode_index,
    encode_index,
    index_lines,
    index_object_bytes,
    index_prefix,
    is_index_key,
    make_index,
    new_put_id,
    pack_layout,
    packed_key,
    parse_index_key,
    part_token,
    partition_of_token,
    partition_prefix,
)
from dataplane.adapters._mc_read import Landing, Reader, ReadOp, Vanished
from dataplane.client import Capabilities, Listing
from dataplane.codec.jagged import round_up
from dataplane.codec.wire import Column
from dataplane.errors import (
    CapacityExceeded,
    DataPlaneTimeout,
    InvalidArgument,
    KeyNotFound,
    missing_rows_error,
)
from dataplane.meta import KVBatchMeta
from dataplane.schema import FieldSchema, check_compatible
from dataplane.store import KVStore, PutRest

__all__ = ["HINT_KEY", "READ_KEY", "MooncakeStore"]

log = logging.getLogger(__name__)

HINT_KEY = "mooncake_index"  # meta.extra_info[HINT_KEY] = {index key: index bytes} of the put
# meta.extra_info[READ_KEY] = [index key, row count, first key, last key, {field: its bytes}, packed
# object bytes or 0, what objects are padded to (see OBJECT_ALIGN)]: enough to start reading a put's
# objects before its index is even decoded (checked against the index meanwhile)
READ_KEY = "mooncake_read"
_ATTEMPTS = 4
_IDS_PER_SWEEP = 64  # put ids per regex of a partition's clear (each sweep scans the master's keys once)
_ORPHAN_AGE_NS = 600 * 10**9  # a clear sweeps data no index names once its put began this long ago
_EARLY_MAX_BYTES = 1 << 30  # larger gets take their sizes from the index (their fixed costs matter less)
_STAGE_BYTES = 64 << 10  # staging buffer of index bodies (one of 4096 rows with a few fields fits)
# what the master's answer to a query costs per key it names, in keys it would list instead: ~3.6 us
# against ~0.5 us (2-core VM, 5,000 keys either way)
_QUERY_COST = 8
_QUERY_MAX_KEYS = 4096  # names per query (its URL holds them all: ~70 bytes each; 5,000 were fine)
# A put of at most this many bytes with two or more non-empty fields is packed into one data object
# (see _mc_index): a rollout put on its own is ~50 KB in 8 fields, and every object costs Mooncake a
# fixed time. A get of some fields of it reads the whole object: at this size that costs less than
# another object would.
_PACK_MAX_BYTES = 1 << 20
# On a host of fewer than _BESIDE_GATED_BELOW_CPUS usable CPUs, planning and decoding beside a read of
# at least _BESIDE_MIN_BYTES start _BESIDE_AFTER_S after the read is issued (see _Gate); smaller reads
# end before waiting would pay.
_BESIDE_GATED_BELOW_CPUS = 4
_BESIDE_MIN_BYTES = 2 << 20
_BESIDE_AFTER_S = 0.0003


def _ids_before(t_ns: int) -> str:
    """A regex matching the time part of put ids (19 digits, :func:`new_put_id`) below ``t_ns``."""
    t = f"{max(0, t_ns):019d}"
    alts = []
    for i, d in enumerate(t):
        if d != "0":
            below = "0" if d == "1" else f"[0-{int(d) - 1}]"
            alts.append(t[:i] + below + (f"[0-9]{{{18 - i}}}" if i < 18 else ""))
    return "|".join(alts) or "(?!)"


def _literal(text: str) -> str:
    """``text`` matched literally by Mooncake's regex (ECMAScript): only its metacharacters escaped."""
    return re.sub(r"([.^$|?*+()\[\]{}\\])", r"\\\1", text)


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
    # put of the field with that schema needs no listing (see put_started)
    mine: dict[str, tuple[str, FieldSchema]] = dataclasses.field(default_factory=dict)


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


class _Gate:
    """Holds a get's Python that runs beside its read (planning, decoding) until the read is under way.

    On the 2-core VM, Python run on another thread of the reader during the first ~0.1-0.3 ms of a
    Mooncake read delays the read by about as long as it runs (a 16 MB read over shared memory:
    +0.55 ms beside a 0.6 ms busy loop, +0.9 ms beside a get's planning and decoding), and by
    nothing once the copy runs; on a 16-core host it delays nothing
    (``benchmarks/results/mooncake_beside_gate*.md``). So on a small host, beside a read large
    enough to be worth it, that work starts :data:`_BESIDE_AFTER_S` after the read is issued.
    """

    __slots__ = ("_hold", "_issued")

    def __init__(self, nbytes: int) -> None:
        self._issued = threading.Event()
        self._hold = nbytes >= _BESIDE_MIN_BYTES and usable_cpus() < _BESIDE_GATED_BELOW_CPUS

    def open(self) -> None:
        """The read is being issued (called right before it, on the reading thread)."""
        self._issued.set()

    def wait(self, deadline: float) -> None:
        """On the helper thread: return once the read has been under way for a moment (at once for
        a small read); never past ``deadline``."""
        if self._hold and self._issued.wait(max(0.0, deadline - time.monotonic())):
            time.sleep(_BESIDE_AFTER_S)


@dataclass(eq=False)
class _EarlyPlan:
    """What a get's ``plan`` found, for its ``finish`` (which may run on another thread)."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    hints: dict[str, PutIndex] | None = None
    hinted: PutIndex | None = None  # the put read, once plan has checked the reads name its objects
    failed: bool = False
    read: bool = False  # whether the read was issued (by plan when it runs in line, else by finish)
    vanished: bool = False  # a concurrent clear removed an object before it was read
    listing: Callable[[], list[str]] | None = None  # the listing asked for after the read


class MooncakeStore(KVStore):
    """See the module docstring."""

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
        self.join_url = ""  # what other processes pass to dataplane.connect() to share this store
        self._parts: dict[str, _Part] = {}
        self._parts_lock = threading.Lock()
        self._caps = Capabilities(
            backend="mooncake", cross_process=True, cross_node=True, zero_copy=True, max_keys_per_call=1024
        )

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def validate_keys(self, keys: Sequence[str]) -> None:
        """Mooncake keys are ASCII (the core already bounds their length at ``meta.MAX_KEY_LEN``)."""
        if "".join(keys).isascii():  # one C-level pass; the loop names the bad key
            return
        bad = next(k for k in keys if not k.isascii())
        raise InvalidArgument(f"Mooncake keys must be ASCII, got {bad[:40]!r}; mint keys like f'{{uid}}_g{{i}}'")

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
        for pid in current.keys() - listed.keys():
            del current[pid]
        unread = []
        for pid in sorted(listed.keys() - current.keys()):
            key, size = listed[pid]
            hinted = hints.get(key)  # names are unique and objects immutable: a listed hint is exact
            if hinted is not None:
                current[pid] = hinted
            else:
                unread.append((pid, key, size))
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
        for (pid, key, size), ptr, room, code in zip(unread, ptrs, rooms, codes, strict=True):
            if code in (room, size):  # padded; or as dataplane wrote index objects before version 4
                got.append((pid, key, ptr - base, size))
            elif code not in (NOT_FOUND, NOT_READY):  # removed after listing, or its put is in flight
                raise error_for(code, f"reading index object {key!r}")
        if not got:
            return {}
        there = self._existing([key for _, key, _, _ in got], deadline)
        return {
            pid: decode_index(key, pid, buf[lo : lo + size].tobytes()) for pid, key, lo, size in got if key in there
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

    # -- put -------------------------------------------------------------------------------------
    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        *,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        return self.put_started(partition_id, timeout_s=timeout_s)(keys, columns, tags)

    def put_started(self, partition_id: str, *, timeout_s: float) -> PutRest:
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
            listing = None
        else:
            existing, listing = None, self._start_listing(deadline)

        def rest(
            keys: Sequence[str], columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]] | None
        ) -> dict[str, Any]:
            nonlocal listing
            if existing is not None:
                alive = existing() or set()
                for name, col in columns.items():
                    key, schema = mine.get(name, ("", None))
                    if schema != col.schema or key not in alive:
                        listing = self._start_listing(deadline)
                        break
            return self._put(partition_id, keys, columns, tags, listing, deadline)

        return rest

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
        :meth:`put_started`)."""
        planned = self._plan_put(partition_id, new_put_id(self.writer), keys, columns, tags)
        lines = None if listing is None else listing()
        part = self._part(partition_id)
        with part.lock:
            if lines is not None:
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

    # -- get -------------------------------------------------------------------------------------
    def get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> Mapping[str, Column]:
        plan, finish = self.get_started(partition_id, keys, fields, meta=meta, timeout_s=timeout_s)
        cols = plan()
        again = finish()
        if again is not None:
            return again
        assert cols is not None
        return cols

    def get_started(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> tuple[Callable[[], Mapping[str, Column] | None], Callable[[], Mapping[str, Column] | None]]:
        """Start a get: ``plan`` makes the columns, ``finish`` moves their bytes (see
        :meth:`KVStore.get_started`).

        A get of exactly the rows of the meta's put (the usual RL read) needs only the meta's read
        hint (:data:`READ_KEY`) to start: it reads the put's objects into buffers taken here and
        then asks for the listing, while the meta's index is decoded and checked to name those
        objects. Where the client has a helper thread, ``plan`` decodes there and ``finish`` reads;
        in line, ``plan`` reads first, so the master answers while the columns are made and decoded.
        A put's objects never change and one removed before the read fails it, so reading before the
        check is safe. ``finish`` then takes the listing: what was read stands when that put's index
        is the partition's only one. When the store changed since that put, ``finish`` resolves
        afresh and keeps what it read if that put still holds the newest value of every row read (a
        later put of other fields, say), or reads again (new columns). Any other get lists, resolves
        and plans here; ``finish`` reads, then asks whether the puts read are still there. Every
        read is trusted only once its put is still there after it (:meth:`_still_there`; a listing
        taken after the read shows that too).
        """
        deadline = time.monotonic() + timeout_s
        self.handle.check()  # closed or forked: fail before any I/O
        part = self._part(partition_id)
        early = self._read_hint(partition_id, keys, fields, meta)
        hints: dict[str, PutIndex] | None = None
        if early is None:
            hints = self._hints(partition_id, meta, part)
            hinted = self._whole_put(keys, fields, hints)
            if hinted is None:
                return self._get_resolved(partition_id, part, keys, fields, hints, deadline)
            early = (hinted.key, *self._put_reads(hinted, fields))
        index_key, ops, landing = early
        planned = _EarlyPlan(hints=hints)
        caller = threading.get_ident()
        gate = _Gate(sum(op.nbytes for op in ops))

        def read() -> None:
            planned.read = True
            gate.open()
            try:
                self.reader.run(ops, deadline, guessed=True)
            except Vanished:
                planned.vanished = True
            planned.listing = self._start_listing(deadline)  # asked for after the read: see _still_there

        def plan() -> Mapping[str, Column] | None:
            try:
                if threading.get_ident() == caller:  # in line: the master answers while columns are made
                    read()
                else:  # beside the read, on the client's helper thread
                    gate.wait(deadline)
                if planned.hints is None:
                    planned.hints = self._hints(partition_id, meta, part)
                p = self._whole_put(keys, fields, planned.hints)
                if p is None or p.key != index_key or not self._names(p, fields, ops):
                    return None  # the read hint does not describe the meta's put: finish reads afresh
                planned.hinted = p
                return self.reader.columns_over(p, fields, landing)
            except BaseException:
                planned.failed = True
                raise
            finally:
                planned.done.set()

        def finish() -> Mapping[str, Column] | None:
            if not planned.read:  # plan runs beside, on the client's helper thread
                read()
            if not planned.done.wait(max(0.0, deadline - time.monotonic())):
                raise DataPlaneTimeout("planning a Mooncake get ran out of time; raise timeout_s")
            if planned.failed:  # the client raises plan's error
                return None
            assert planned.listing is not None
            lines = planned.listing()
            hinted, hints = planned.hinted, planned.hints or {}
            if hinted is None or planned.vanished:
                lines_ok = None if planned.vanished else lines
                return self._get_checked(partition_id, part, keys, fields, hints, deadline, lines_ok)
            if self._only_put(partition_id, part, hinted, lines):
                return None
            # Other puts or tombstones are listed: what was read stands if that put still holds the
            # newest value of every row read (a later put of other fields, say); else read again.
            # (A put no longer listed holds none: its bytes are not trusted either.)
            resolved = self._resolve(partition_id, part, keys, fields, hints, lines, deadline)
            if all(self._only_from(r, hinted) for r in resolved.values()):
                return None
            return self._get_checked(partition_id, part, keys, fields, hints, deadline, lines, resolved)

        return plan, finish

    def _get_resolved(
        self,
        partition_id: str,
        part: _Part,
        keys: Sequence[str],
        fields: Sequence[str],
        hints: dict[str, PutIndex],
        deadline: float,
    ) -> tuple[Callable[[], Mapping[str, Column] | None], Callable[[], Mapping[str, Column] | None]]:
        """A get of anything but the rows of one put in its order: list, resolve, plan; read in ``finish``."""
        resolved = self._resolve(partition_id, part, keys, fields, hints, self._listing(deadline), deadline)
        cols, fill = self.reader.plan(resolved)
        caller = threading.get_ident()
        gate = _Gate(sum(c.values.nbytes for c in cols.values()))

        def planned() -> Mapping[str, Column] | None:
            if threading.get_ident() != caller:  # decoded beside the read, on the client's helper thread
                gate.wait(deadline)
            return cols

        def finish() -> Mapping[str, Column] | None:
            check: list[Callable[[], bool]] = []
            gate.open()
            try:  # the check is asked once the reads are done; staged rows are gathered meanwhile
                fill(deadline, lambda: check.append(self._start_still_there(resolved, deadline)))
            except Vanished:  # a concurrent clear removed an object: resolve and read again
                return self._get_checked(partition_id, part, keys, fields, hints, deadline)
            if check[0]():
                return None
            return self._get_checked(partition_id, part, keys, fields, hints, deadline)

        return planned, finish

    def _read_hint(
        self, partition_id: str, keys: Sequence[str], fields: Sequence[str], meta: KVBatchMeta | None
    ) -> tuple[str, list[ReadOp], Landing] | None:
        """The reads of a get of exactly the rows of the meta's put, from its read hint alone (no
        index decoded), and where they land; None when the hint is absent or does not fit the get.
        Only objects of this partition can be named; ``plan`` checks they are the put's."""
        hint = meta.extra_info.get(READ_KEY) if meta is not None else None
        if not isinstance(hint, (list, tuple)) or len(hint) != 7:
            return None
        index_key, n, first, last, sizes, packed, pad = hint
        if not (isinstance(index_key, str) and isinstance(sizes, Mapping) and n == len(keys) and n > 0):
            return None
        if keys[0] != first or keys[-1] != last or type(packed) is not int or not 0 <= packed <= _PACK_MAX_BYTES:
            return None
        if pad not in (1, OBJECT_ALIGN):
            return None
        want = [sizes.get(f) for f in fields]
        nbytes = [n for n in want if type(n) is int and n >= 0]
        if len(nbytes) != len(want) or sum(nbytes) > _EARLY_MAX_BYTES:
            return None  # a hint is only the meta's word: no allocation it could inflate beyond this
        prefix = index_prefix(self.ns, partition_id)
        parsed = parse_index_key(index_key, prefix) if index_key.startswith(prefix) else None
        if parsed is None:
            return None
        head = partition_prefix(self.ns, partition_id)
        if packed:  # the whole object; where each field lies in it comes from the index (plan)
            return index_key, *self.reader.packed_read(packed_key(head, parsed[0]), round_up(packed, pad))
        return index_key, *self.reader.whole_reads(
            {f: (data_key(head, parsed[0], f), n, round_up(n, pad)) for f, n in zip(fields, nbytes, strict=True)}
        )

    def _put_reads(self, put: PutIndex, fields: Sequence[str]) -> tuple[list[ReadOp], Landing]:
        """The reads of ``fields`` of every row of ``put`` (a packed put's one object, whole)."""
        if put.packed:
            return self.reader.packed_read(packed_key(put.head, put.put_id), put.stored(put.packed))
        return self.reader.whole_reads(
            {f: (put.data_key(f), put.fields[f].nbytes, put.stored(put.fields[f].nbytes)) for f in fields}
        )

    @staticmethod
    def _only_from(res: Resolved, p: PutIndex) -> bool:
        """Whether every row of ``res`` is row j of put ``p`` at position j (what a whole read of it got)."""
        if res.whole is not None:
            return res.whole.put_id == p.put_id
        if len(res.puts) != 1 or res.puts[0].put_id != p.put_id:
            return False
        return bool((res.rows == np.arange(len(res.rows))).all())

    @staticmethod
    def _names(hinted: PutIndex, fields: Sequence[str], ops: Sequence[ReadOp]) -> bool:
        """Whether ``ops`` read exactly the objects of ``fields`` in put ``hinted`` (a packed put's
        one object, whole)."""
        if hinted.packed:
            want = [(packed_key(hinted.head, hinted.put_id), hinted.stored(hinted.packed))]
        else:
            want = [
                (hinted.data_key(f), hinted.stored(hinted.fields[f].nbytes)) for f in fields if hinted.fields[f].nbytes
            ]
        return want == [(op.key, op.nbytes) for op in ops]

    @staticmethod
    def _whole_put(keys: Sequence[str], fields: Sequence[str], hints: Mapping[str, PutIndex]) -> PutIndex | None:
        """The meta's one put when the get asks for all of its rows in its order (the usual RL read)."""
        if len(hints) != 1:
            return None
        (p,) = hints.values()
        if p.op != "put" or tuple(keys) != p.keys or not all(f in p.fields for f in fields):
            return None
        return p

    def _only_put(self, partition_id: str, part: _Part, p: PutIndex, lines: Sequence[str]) -> bool:
        """Whether the rows of put ``p`` can be read without folding rows: the listing shows exactly one
        index in the partition, ``p``'s (no other write, no tombstone). The listing is the truth: any
        other put this cache still holds was cleared (usually by the writer, after the previous step's
        read) and is dropped. The put is kept in the cache unfolded; the next operation that needs the
        partition's state folds it (:meth:`_refresh`)."""
        prefix = index_prefix(self.ns, partition_id)
        if [ln for ln in lines if ln.startswith(prefix)] != [p.key]:
            return False
        with part.lock:
            if part.known.keys() - {p.put_id}:
                part.state = PartitionState()  # folded rows of cleared puts: rebuilt when next needed
            part.known = {p.put_id: p}
        return True

    def _resolve(
        self,
        partition_id: str,
        part: _Part,
        keys: Sequence[str],
        fields: Sequence[str],
        hints: Mapping[str, PutIndex],
        lines: list[str],
        deadline: float,
    ) -> dict[str, Resolved]:
        """Where every requested row lives according to ``lines``, or raises ``KeyNotFound``."""
        with part.lock:
            state = self._refresh(partition_id, part, lines, hints, deadline)
            missing_keys, missing_fields, resolved = state.resolve(keys, fields)
        if missing_keys or missing_fields:
            raise self._missing(partition_id, missing_keys, missing_fields, hints, lines)
        return resolved

    def _get_checked(
        self,
        partition_id: str,
        part: _Part,
        keys: Sequence[str],
        fields: Sequence[str],
        hints: Mapping[str, PutIndex],
        deadline: float,
        lines: list[str] | None = None,
        resolved: dict[str, Resolved] | None = None,
    ) -> Mapping[str, Column]:
        """List (unless given the listing ``lines``), resolve (unless given what ``lines`` resolve to),
        read, and keep what was read if every put it came from is still there after the read
        (:meth:`_still_there`); else again."""
        for attempt in itertools.count():
            if attempt:  # the puts read were removed under the read: rows rewritten and cleared meanwhile
                if time.monotonic() >= deadline:
                    raise DataPlaneTimeout(
                        f"partition {partition_id!r}: the puts holding these rows were removed while they "
                        f"were read, {attempt} times in a row until timeout_s; another process keeps "
                        "rewriting and clearing them (or a store server died). Raise timeout_s, or read "
                        "rows once their writers are done with them"
                    )
                if attempt >= 4:  # under heavy churn, let a burst of clears pass
                    time.sleep(min(0.05, 0.001 * 2 ** (attempt - 4)))
            if lines is None:
                lines = self._listing(deadline)
            if resolved is None:
                resolved = self._resolve(partition_id, part, keys, fields, hints, lines, deadline)
            try:
                cols = self.reader.read(resolved, deadline)
            except Vanished:
                lines = resolved = None
                continue
            if self._still_there(resolved, deadline):
                return cols
            lines = resolved = None
        raise AssertionError("unreachable")

    @staticmethod
    def _missing(
        partition_id: str,
        missing_keys: list[str],
        missing_fields: dict[str, list[str]],
        hints: Mapping[str, PutIndex],
        lines: Sequence[str],
    ) -> KeyNotFound:
        err = missing_rows_error(partition_id, missing_keys, missing_fields)
        listed = set(lines)
        gone = [key for key in hints if key not in listed]
        if not gone:
            return err
        return KeyNotFound(
            f"{err}. The put that returned this meta is no longer in the store: its rows were cleared, or "
            "the store server holding them died"
        )

    def _hints(self, partition_id: str, meta: KVBatchMeta | None, part: _Part) -> dict[str, PutIndex]:
        """Index objects a put returned in its meta (used only once a listing shows them)."""
        raw = meta.extra_info.get(HINT_KEY) if meta is not None else None
        if not isinstance(raw, Mapping):
            return {}
        prefix = index_prefix(self.ns, partition_id)
        out = {}
        for key, body in raw.items():
            parsed = parse_index_key(key, prefix) if isinstance(key, str) and key.startswith(prefix) else None
            if parsed is not None and isinstance(body, bytes) and len(body) == parsed[1]:
                known = part.known.get(parsed[0])  # names are unique and index objects immutable
                out[key] = known if known is not None and known.key == key else decode_index(key, parsed[0], body)
        return out

    # -- clear / list ----------------------------------------------------------------------------
    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        part = self._part(partition_id)
        if keys is None:
            lines = self._listing(deadline)
            with part.lock:
                self._remove_listed(partition_id, part, lines)
                part.known, part.state, part.mine = {}, PartitionState(), {}
            self._forget(partition_id, part)
            return
        lines = self._listing(deadline)
        with part.lock:
            state = self._refresh(partition_id, part, lines, {}, deadline)
            doomed = [k for k in keys if k in state.rows]
            if not doomed:
                return
            garbage, need_tombstone = state.garbage_after_delete(doomed)
            known = dict(part.known)
            doomed_objects = [k for p in garbage for k in p.object_keys()]
            if need_tombstone:  # first: removing first could briefly resurrect older values of doomed keys
                put_id = new_put_id(self.writer)
                body = encode_index(doomed, {}, None, op="del")
                key = f"{index_prefix(self.ns, partition_id)}{put_id}.{len(body)}"
                ptr, buf = self._sendable_bytes(body)
                try:
                    self._write([key], [ptr], [index_object_bytes(len(body))], partition_id, deadline)
                except CapacityExceeded:  # a full store must still be clearable: free space, then retry
                    self._remove(doomed_objects)
                    doomed_objects = []
                    self._write([key], [ptr], [index_object_bytes(len(body))], partition_id, deadline)
                finally:
                    self._unstage(buf)
                known[put_id] = decode_index(key, put_id, body)
            self._remove(doomed_objects)
            for p in garbage:
                known.pop(p.put_id, None)
            part.known = known
            part.state = part.state.refresh(known)
        if not known:
            self._forget(partition_id, part)

    def _remove_listed(self, partition_id: str, part: _Part, lines: Sequence[str]) -> None:
        """Remove every put of the partition that ``lines`` list: their index objects, then their data
        objects (see :meth:`_remove`), matched by put id; then data objects that no index names, of
        puts begun over 10 minutes ago (their writer died mid-put). A put listed only later (one
        racing this clear) is left whole: sweeping the partition's data by prefix could take the
        data of a put whose index lands between the two removals, leaving an index naming nothing."""
        listed = part.lines.update(lines, index_prefix(self.ns, partition_id))  # call with part.lock held
        self._remove([key for key, _ in listed.values()])
        head = _literal(data_prefix(self.ns, partition_id))
        ids = [_literal(pid) for pid in sorted(listed)]
        for at in range(0, len(ids), _IDS_PER_SWEEP):
            self.handle.remove_regex(f"^{head}({'|'.join(ids[at : at + _IDS_PER_SWEEP])})/")
        # data no index names: a writer died mid-put. Only puts begun long ago: a younger one may still
        # be writing its index, and put ids begin with the writer's clock.
        self.handle.remove_regex(f"^{head}({_ids_before(time.time_ns() - _ORPHAN_AGE_NS)})-")

    def _forget(self, partition_id: str, part: _Part) -> None:
        """Drop the cache of a partition left empty (jobs often use a fresh partition per step)."""
        with self._parts_lock:
            if self._parts.get(partition_id) is part and not part.known and not part.pending:
                del self._parts[partition_id]

    def _remove(self, keys: list[str]) -> None:
        """Force-remove ``keys``: index objects first, then (once the master has dropped them) the data
        objects. A reader trusts what it read only while the put's index is still there after the
        read (:meth:`_still_there`), so no data object may go while its index can still be found."""
        index = [k for k in keys if is_index_key(k)]
        data = [k for k in keys if not is_index_key(k)]
        bad = [c for group in (index, data) if group for c in self.handle.remove(group) if c not in (0, NOT_FOUND)]
        if bad:
            log.warning("dataplane: removing %d objects failed: %s", len(bad), code_name(bad[0]))

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        deadline = time.monotonic() + timeout_s
        lines = self._listing(deadline)
        if partition_id is not None:
            pids = [partition_id]
        else:
            head = f"{self.ns}/"
            tokens = {ln[len(head) :].split("/", 1)[0] for ln in lines if ln.startswith(head) and "/i/" in ln}
            pids = sorted(partition_of_token(t) for t in tokens if part_token(partition_of_token(t)) == t)
        out: Listing = {}
        for pid in pids:
            part = self._part(pid)
            with part.lock:
                rows = self._refresh(pid, part, lines, {}, deadline).listing()
            if rows:
                out[pid] = rows
        return out

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
