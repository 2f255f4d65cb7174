"""``memory://``: an in-process, thread-safe, capacity-bounded store.

The default for one process, for tests, and the benchmark's baseline. A put copies each column once
into pooled memory (the caller may mutate its tensors afterwards); a get copies the requested rows
once into pooled memory the caller owns. Locks are held only for bookkeeping, never for copies:
stored tensors are never mutated in place, a re-write swaps in new ones. Two surfaces of
:mod:`dataplane.adapters.read_into` let the worker's GPU path skip a copy: a get can land window by
window in the caller's buffers (``begin_read_into``), and a put can keep host tensors the caller
hands over (``adopting``). ``client.empty()`` hands out pooled memory.

``memory://`` is a private store; ``memory://NAME`` is shared by every client in the process that
names it, and lives until the last of them closes. Memory is per process: another process that
connects to ``memory://NAME`` gets a store of its own, empty, and a get there by a meta this one
wrote raises ``DeploymentMismatch``. For several processes use ``mooncake://`` or ``tq://``.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch

from dataplane._host.bufpool import BufferPool
from dataplane._host.slots import NONE, add_keys, described, grown, lookup, merged_tags
from dataplane.adapters._memory_claims import MemoryClaims
from dataplane.adapters._memory_read import Chunk, Read, WindowedMemoryRead, assemble
from dataplane.checks import check_bytes
from dataplane.client import Capabilities, Listing
from dataplane.codec.wire import Column
from dataplane.errors import CapacityExceeded, DataPlaneTimeout, InvalidArgument, missing_rows_error
from dataplane.meta import KVBatchMeta, RowInfo
from dataplane.registry import check_options, url_option
from dataplane.schema import FieldSchema, check_compatible
from dataplane.storage import KVStore
from dataplane.store_client import StoreClient

__all__ = ["MemoryConfig", "MemoryStore", "connect"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryConfig:
    """Options of ``memory://`` (also accepted as URL query parameters).

    Attributes:
        name: share one store between the clients of this process that use the same name.
        capacity_bytes: most bytes of tensor data held; a put beyond it raises CapacityExceeded. A
            size as every byte option takes it: ``67108864``, ``"64MiB"``, ``"1GiB"``
            (:func:`dataplane.checks.check_bytes`).
        capacity_rows: most rows (distinct keys over all partitions) held.
        timeout_s: bound on every call.
        pickle_fields: object fields that may use pickle (opt-in by name).
    """

    name: str | None = None
    capacity_bytes: int | None = None
    capacity_rows: int | None = None
    timeout_s: float = 60.0
    pickle_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", check_bytes("capacity_bytes", self.capacity_bytes, allow_none=True))

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryConfig:
        parsed = urlparse(url)
        if parsed.scheme != "memory":
            raise InvalidArgument(f"not a memory:// URL: {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        known = [f.name for f in fields(cls)]
        check_options("memory", query, [k for k in known if k != "name"])  # the name is the URL's host
        check_options("memory", options, known, how="keyword")
        values: dict[str, Any] = {}
        for key, raw in query.items():
            if key == "capacity_bytes":
                values[key] = raw  # a size, parsed as every byte option is (__post_init__)
            elif key == "capacity_rows":
                values[key] = url_option(url, key, raw, lambda r: int(float(r)))
            elif key == "timeout_s":
                values[key] = url_option(url, key, raw, float)
            elif key == "pickle_fields":
                values[key] = tuple(x for x in raw.split(",") if x)
        name = (parsed.netloc + parsed.path).strip("/") or None
        return cls(**{"name": name, **values, **options})


class _Partition:
    """Rows as columns, not objects: each live key has a slot, and each field arrays over slots of
    the put (block, by number) holding its newest value, and where that value starts in the put's
    chunk and its length (leading-dim units: 1 row of a dense field). A batch of 64K rows would
    otherwise be 64K objects for the garbage collector to walk again and again, and to visit one by
    one on every get and clear; and a get finds every row's bytes with no per-put lookup, however
    many puts its rows come from."""

    __slots__ = ("blocks", "claims", "cols", "free", "next_block", "rows", "schema", "slots", "tagged")

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}  # live key -> slot
        self.schema: dict[str, FieldSchema] = {}
        self.cols: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # field -> (block, start, length)
        self.blocks: dict[int, dict[str, Chunk]] = {}  # put (by number) -> its chunks some row still reads
        self.next_block = 0
        self.slots = 0  # slots handed out
        self.free: list[int] = []  # slots of cleared keys, handed out again
        self.tagged: list[tuple[np.ndarray, tuple[dict[str, Any], ...]]] = []  # (slot per row, tags) per put
        self.claims: dict[str, set[int]] = {}  # task -> slots it claimed (a cleared slot leaves every set)

    def slots_of(self, keys: Sequence[str], found: np.ndarray) -> np.ndarray:
        """The slot of each of ``keys`` (distinct; ``found``: their :func:`lookup`), new keys getting
        free or new ones."""
        slots = found.copy()
        fresh = np.flatnonzero(slots == NONE)
        if len(fresh):
            reuse = min(len(fresh), len(self.free))
            taken = self.free[len(self.free) - reuse :]
            del self.free[len(self.free) - reuse :]
            new = np.concatenate(
                (np.array(taken, dtype=np.int64), np.arange(self.slots, self.slots + len(fresh) - reuse))
            )
            self.slots += len(fresh) - reuse
            add_keys(self.rows, keys, slots, fresh, new)
            for name, cols in self.cols.items():
                if len(cols[0]) < self.slots:  # grow every field's columns (doubling)
                    size = max(self.slots, 2 * len(cols[0]))
                    self.cols[name] = (grown(cols[0], size), grown(cols[1], size), grown(cols[2], size))
        return slots

    def superseded(self, slots: np.ndarray, fields: Iterable[str]) -> list[tuple[str, int, int]]:
        """(field, block, how many of rows ``slots`` read ``field`` from that block's chunk)."""
        out: list[tuple[str, int, int]] = []
        for f in fields:
            cols = self.cols.get(f)
            if cols is not None and len(slots):
                blocks = cols[0][slots]
                numbers, counts = np.unique(blocks[blocks != NONE], return_counts=True)
                out += [(f, b, c) for b, c in zip(numbers.tolist(), counts.tolist(), strict=True)]
        return out

    def drop(self, slots: np.ndarray, fields: Iterable[str]) -> int:
        """Rows ``slots`` no longer read ``fields``; returns the bytes of chunks no row reads any more."""
        freed = 0
        fields = list(fields)
        for f, b, n in self.superseded(slots, fields):
            chunks = self.blocks[b]
            chunk = chunks[f]
            chunk.live -= n
            if chunk.live == 0:
                freed += chunk.nbytes
                del chunks[f]  # releases the buffer
                if not chunks:
                    del self.blocks[b]
        for f in fields:
            cols = self.cols.get(f)
            if cols is not None:
                cols[0][slots] = NONE
        return freed

    def forget(self, slots: np.ndarray) -> None:
        """Cleared slots: their tags go, and they are handed out again."""
        kept = []
        for tslots, tags in self.tagged:
            gone = np.isin(tslots, slots)
            if gone.any():
                tslots = np.where(gone, NONE, tslots)
            if (tslots != NONE).any():
                kept.append((tslots, tags))
        self.tagged = kept
        self.free += slots.tolist()
        for taken in self.claims.values():
            taken.difference_update(slots.tolist())

    def holding(self, slots: np.ndarray, fields: Iterable[str]) -> np.ndarray:
        """Per slot of ``slots``: whether it holds every one of ``fields``."""
        has = np.ones(len(slots), dtype=bool)
        for f in fields:
            cols = self.cols.get(f)
            has &= False if cols is None else cols[0][slots] != NONE
        return has

    def listing(self) -> dict[str, dict[str, Any]]:
        """Every live key with its tags (merged over the puts that wrote it, in order)."""
        return merged_tags(self.tagged, self.rows)

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cols = self.cols.get(name)
        if cols is None:
            size = max(self.slots, 1024)
            cols = self.cols[name] = (np.full(size, NONE, dtype=np.int64), *np.zeros((2, size), dtype=np.int64))
        return cols


def _stored_copy(
    col: Column, pool: BufferPool, offsets: dict[int, torch.Tensor], adopt: set[tuple[int, int]] | None = None
) -> Chunk:
    """Copy a column once into pooled memory (columns that share an offsets tensor share its copy),
    or keep its values as they are where the caller handed them over (:meth:`MemoryStore.adopting`)."""
    values = col.values
    if adopt and values.is_cpu and values.is_contiguous() and (values.data_ptr(), values.nbytes) in adopt:
        buf = values
    else:
        buf = pool.tensor(tuple(values.shape), values.dtype)
        buf.copy_(values)
    if col.offsets is None:
        return Chunk(buf, None)
    own = offsets.get(id(col.offsets))
    if own is None:
        own = offsets[id(col.offsets)] = col.offsets.clone()
    return Chunk(buf, own)


class MemoryStore(MemoryClaims, KVStore):
    """The memory adapter's store. See the module docstring (claims: :class:`MemoryClaims`)."""

    def __init__(self, config: MemoryConfig | None = None) -> None:
        cfg = config or MemoryConfig()
        for name in ("capacity_bytes", "capacity_rows"):
            value = getattr(cfg, name)
            if value is not None and value < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {value}")
        self.config = cfg
        self._lock = threading.Lock()
        self._parts: dict[str, _Partition] = {}
        self._finished: set[str] = set()  # partitions a producer marked finished (mark_finished)
        self._rows = 0
        self._bytes = 0
        self._pool = BufferPool(min(cfg.capacity_bytes or (2 << 30), 2 << 30))
        self._caps = Capabilities(backend="memory", cross_process=False, cross_node=False, zero_copy=True)
        self._adopt = threading.local()  # .held: (data_ptr, nbytes) of tensors this thread's puts keep
        # per store object: another store of the same name (another process, or after this one closed)
        # is another deployment
        self._id = f"memory://{cfg.name or ''}#{os.getpid()}-{uuid.uuid4().hex[:12]}"

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def url(self) -> str:
        """``memory://NAME`` for a named store, "" for a private one. Memory is per process: the URL
        reaches this store from clients of this process only."""
        return f"memory://{self.config.name}" if self.config.name is not None else ""

    @property
    def deployment_id(self) -> str:
        return self._id

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def used_rows(self) -> int:
        return self._rows

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pooled host memory (faulted in already, reused): what a put copies from fastest."""
        return self._pool.tensor(shape, dtype)

    @contextlib.contextmanager
    def adopting(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """A scope in which this thread's puts keep each of ``tensors`` (whole, contiguous host tensors)
        that a column's values are, as they are, instead of copying them: the caller hands them over
        and must not write them afterwards (:mod:`dataplane.adapters.read_into`)."""
        before = getattr(self._adopt, "held", None)
        self._adopt.held = {(t.data_ptr(), t.nbytes) for t in tensors if t.is_cpu and t.is_contiguous()}
        try:
            yield
        finally:
            self._adopt.held = before

    def _acquire(self, timeout_s: float) -> None:
        if not self._lock.acquire(timeout=timeout_s):
            raise DataPlaneTimeout(f"memory store busy for {timeout_s}s; raise timeout_s or look for a stuck caller")

    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        *,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        cfg = self.config
        incoming = sum(col.values.numel() * col.values.element_size() for col in columns.values())
        if cfg.capacity_bytes is not None and incoming > cfg.capacity_bytes:
            raise CapacityExceeded(
                f"a put of {incoming} bytes can never fit a memory store of capacity_bytes={cfg.capacity_bytes}; "
                "split the batch or raise capacity_bytes"
            )
        shared: dict[int, torch.Tensor] = {}
        adopt = getattr(self._adopt, "held", None)
        chunks = {field: _stored_copy(col, self._pool, shared, adopt) for field, col in columns.items()}
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            known = part.schema if part is not None else {}
            for field, col in columns.items():
                if field in known:
                    check_compatible(partition_id, field, known[field], col.schema)
            found = lookup(part.rows if part is not None else {}, keys)
            held = found[found != NONE]
            new_rows = len(keys) - len(held)
            if cfg.capacity_rows is not None and self._rows + new_rows > cfg.capacity_rows:
                raise CapacityExceeded(
                    f"memory store holds {self._rows} of capacity_rows={cfg.capacity_rows} rows; "
                    f"this put adds {new_rows}. Clear consumed rows (kv_clear) or raise capacity_rows"
                )
            if cfg.capacity_bytes is not None:
                freed = 0
                if part is not None:
                    chunks_read = ((part.blocks[b][f], n) for f, b, n in part.superseded(held, columns))
                    freed = sum(c.nbytes for c, n in chunks_read if n == c.live)
                if self._bytes - freed + incoming > cfg.capacity_bytes:
                    raise CapacityExceeded(
                        f"memory store holds {self._bytes} of capacity_bytes={cfg.capacity_bytes} bytes; this put "
                        f"needs {incoming - freed} more. Clear consumed rows (kv_clear) or raise capacity_bytes"
                    )
            # Validated: apply. Nothing below can fail.
            if part is None:
                part = self._parts[partition_id] = _Partition()
            for field, col in columns.items():
                part.schema.setdefault(field, col.schema)
            self._bytes -= part.drop(held, columns)
            slots = part.slots_of(keys, found)
            number = part.next_block
            part.next_block += 1
            part.blocks[number] = chunks
            rows_at = np.arange(len(keys), dtype=np.int64)
            for field, chunk in chunks.items():
                block, start, length = part.column(field)
                block[slots] = number
                if chunk.offsets is None:
                    start[slots], length[slots] = rows_at, 1
                else:
                    offsets = chunk.offsets.numpy()
                    start[slots], length[slots] = offsets[:-1], np.diff(offsets)
            if tags is not None:
                part.tagged.append((slots, tuple(dict(t) for t in tags)))
            self._rows += new_rows
            self._bytes += sum(chunk.nbytes for chunk in chunks.values())
        finally:
            self._lock.release()
        return None

    def get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> Mapping[str, Column]:
        # Copied outside the lock: a stored buffer is never written after its put publishes it, and
        # the reads hold the chunks alive even if a concurrent put or clear drops them.
        return assemble(*self._reads(partition_id, keys, fields, timeout_s), fields)

    def begin_read_into(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> WindowedMemoryRead:
        """The get planned, its bytes copied into the caller's buffers on demand
        (:mod:`dataplane.adapters.read_into`)."""
        return WindowedMemoryRead(*self._reads(partition_id, keys, fields, timeout_s), fields)

    def _reads(
        self, partition_id: str, keys: Sequence[str], fields: Sequence[str], timeout_s: float
    ) -> tuple[dict[str, FieldSchema], dict[str, Read]]:
        """Where the rows of a get are (under the lock), or ``KeyNotFound``."""
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            slots = lookup(part.rows if part is not None else {}, keys)
            if part is None or (slots == NONE).any():
                raise missing_rows_error(partition_id, [keys[i] for i in np.flatnonzero(slots == NONE).tolist()])
            missing_fields: dict[str, list[str]] = {}
            for f in fields:
                cols = part.cols.get(f)
                absent = np.arange(len(keys)) if cols is None else np.flatnonzero(cols[0][slots] == NONE)
                if len(absent):
                    missing_fields[f] = [keys[j] for j in absent.tolist()]
            if missing_fields:
                raise missing_rows_error(partition_id, (), missing_fields)
            schemas = {f: part.schema[f] for f in fields}
            reads: dict[str, Read] = {}
            sources: list[tuple[np.ndarray, list[int], np.ndarray | None]] = []
            for f in fields:
                blocks, starts, lengths = (c[slots] for c in part.cols[f])
                # fields read alike (the common case: all of them) find their puts once
                alike = next((s for s in sources if np.array_equal(s[0], blocks)), None)
                if alike is None:
                    if not len(blocks) or blocks.min() == blocks.max():
                        alike = (blocks, [int(blocks[0])] if len(blocks) else [], None)
                    else:  # rows from several puts (written back by several ranks, or put one by one)
                        distinct, inverse = np.unique(blocks, return_inverse=True)
                        alike = (blocks, distinct.tolist(), inverse)
                    sources.append(alike)
                _, numbers, which = alike
                reads[f] = Read([part.blocks[b][f] for b in numbers], which, starts, lengths)
        finally:
            self._lock.release()
        return schemas, reads

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        self._acquire(timeout_s)
        try:
            if keys is None:
                self._finished.discard(partition_id)
            part = self._parts.get(partition_id)
            if part is None:
                return
            doomed = list(part.rows) if keys is None else [k for k in dict.fromkeys(keys) if k in part.rows]
            slots = np.array([part.rows.pop(k) for k in doomed], dtype=np.int64)
            self._bytes -= part.drop(slots, list(part.cols))
            part.forget(slots)
            self._rows -= len(doomed)
            if not part.rows:
                del self._parts[partition_id]
        finally:
            self._lock.release()

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        self._acquire(timeout_s)
        try:
            partition_ids = [partition_id] if partition_id is not None else list(self._parts)
            return {part_id: self._parts[part_id].listing() for part_id in partition_ids if part_id in self._parts}
        finally:
            self._lock.release()

    def describe(self, partition_id: str, keys: Sequence[str], *, timeout_s: float) -> builtins.list[RowInfo | None]:
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            if part is None:
                return [None] * len(keys)
            found = described(lookup(part.rows, keys), {f: c[0] for f, c in part.cols.items()}, part.tagged)
        finally:
            self._lock.release()
        return [None if x is None else RowInfo(*x) for x in found]

    def close(self) -> None:
        with self._lock:
            self._parts.clear()
            self._rows = self._bytes = 0
        self._pool.close()


_SHARED: dict[str, tuple[MemoryStore, int]] = {}
_SHARED_LOCK = threading.Lock()


class _SharedRef(KVStore):
    """One client's reference to a named store; the last reference to close releases it."""

    def __init__(self, target: MemoryStore) -> None:
        self.target = target
        self._closed = False

    @property
    def capabilities(self) -> Capabilities:
        return self.target.capabilities

    @property
    def url(self) -> str:
        return self.target.url

    @property
    def deployment_id(self) -> str:
        return self.target.deployment_id

    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        *,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        return self.target.put(partition_id, keys, columns, tags, timeout_s=timeout_s)

    def get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> Mapping[str, Column]:
        return self.target.get(partition_id, keys, fields, meta=meta, timeout_s=timeout_s)

    def begin_read_into(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> WindowedMemoryRead:
        return self.target.begin_read_into(partition_id, keys, fields, meta=meta, timeout_s=timeout_s)

    def adopting(self, tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        return self.target.adopting(tensors)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.target.empty(shape, dtype)

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        self.target.clear(partition_id, keys, timeout_s=timeout_s)

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        return self.target.list(partition_id, timeout_s=timeout_s)

    def describe(self, partition_id: str, keys: Sequence[str], *, timeout_s: float) -> builtins.list[RowInfo | None]:
        return self.target.describe(partition_id, keys, timeout_s=timeout_s)

    def claim(
        self, partition_id: str, task_name: str, fields: Sequence[str], n: int, tag_filter: Any, *, timeout_s: float
    ) -> Any:
        return self.target.claim(partition_id, task_name, fields, n, tag_filter, timeout_s=timeout_s)

    def consumption(
        self, partition_id: str, task_name: str, fields: Sequence[str], tag_filter: Any, *, timeout_s: float
    ) -> Any:
        return self.target.consumption(partition_id, task_name, fields, tag_filter, timeout_s=timeout_s)

    def reset_claims(self, partition_id: str, task_name: str | None, *, timeout_s: float) -> None:
        self.target.reset_claims(partition_id, task_name, timeout_s=timeout_s)

    def mark_finished(self, partition_id: str, finished: bool, *, timeout_s: float) -> None:
        self.target.mark_finished(partition_id, finished, timeout_s=timeout_s)

    def close(self) -> None:
        name = self.target.config.name
        assert name is not None
        with _SHARED_LOCK:
            if self._closed:
                return
            self._closed = True
            store, refs = _SHARED[name]
            if refs > 1:
                _SHARED[name] = (store, refs - 1)
                return
            del _SHARED[name]
        self.target.close()


def connect(url_or_config: str | MemoryConfig | None = None, **options: Any) -> StoreClient:
    """Open a ``memory://`` client (see :class:`MemoryConfig` for options)."""
    if isinstance(url_or_config, MemoryConfig):
        check_options("memory", options, [f.name for f in fields(MemoryConfig)], how="keyword")
        cfg = replace(url_or_config, **options)
    else:
        cfg = MemoryConfig.from_url(url_or_config or "memory://", **options)
    store: KVStore
    if cfg.name is None:
        store = MemoryStore(cfg)
    else:
        with _SHARED_LOCK:
            if cfg.name in _SHARED:
                shared, refs = _SHARED[cfg.name]
                _SHARED[cfg.name] = (shared, refs + 1)
            else:
                shared = MemoryStore(cfg)
                _SHARED[cfg.name] = (shared, 1)
        store = _SharedRef(shared)
    return StoreClient(store, timeout_s=cfg.timeout_s, pickle_fields=cfg.pickle_fields)
