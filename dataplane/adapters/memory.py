"""``memory://``: an in-process, thread-safe, capacity-bounded store.

The default for one process, for tests, and the benchmark's baseline. A put copies each column once
into pooled memory (the caller may mutate its tensors afterwards); a get copies the requested rows
once into pooled memory the caller owns. Locks are held only for bookkeeping, never for copies:
stored tensors are never mutated in place, a re-write swaps in new ones.

``memory://`` is a private store; ``memory://NAME`` is shared by every client in the process that
names it, and lives until the last of them closes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch

from dataplane.adapters._slots import NONE, grown, merged_tags
from dataplane.bufpool import BufferPool, default_pool
from dataplane.client import Capabilities, Listing
from dataplane.codec.jagged import offsets_from_lengths
from dataplane.codec.wire import Column
from dataplane.errors import CapacityExceeded, DataPlaneTimeout, InvalidArgument, missing_rows_error
from dataplane.hostcopy import gather_bytes
from dataplane.meta import KVBatchMeta
from dataplane.registry import url_option
from dataplane.schema import FieldSchema, check_compatible
from dataplane.store import KVStore, StoreClient

__all__ = ["MemoryConfig", "MemoryStore", "connect"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryConfig:
    """Options of ``memory://`` (also accepted as URL query parameters).

    Attributes:
        name: share one store between the clients of this process that use the same name.
        capacity_bytes: most bytes of tensor data held; a put beyond it raises CapacityExceeded.
        capacity_rows: most rows (distinct keys over all partitions) held.
        timeout_s: bound on every call.
        pickle_fields: object fields that may use pickle (opt-in by name).
    """

    name: str | None = None
    capacity_bytes: int | None = None
    capacity_rows: int | None = None
    timeout_s: float = 60.0
    pickle_fields: tuple[str, ...] = ()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryConfig:
        parsed = urlparse(url)
        if parsed.scheme != "memory":
            raise InvalidArgument(f"not a memory:// URL: {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        values: dict[str, Any] = {}
        for key, raw in query.items():
            if key in ("capacity_bytes", "capacity_rows"):
                values[key] = url_option(url, key, raw, lambda r: int(float(r)))
            elif key == "timeout_s":
                values[key] = url_option(url, key, raw, float)
            elif key == "pickle_fields":
                values[key] = tuple(x for x in raw.split(",") if x)
            else:
                raise InvalidArgument(f"unknown memory:// option {key!r}; known: {sorted(cls.__dataclass_fields__)}")
        name = (parsed.netloc + parsed.path).strip("/") or None
        return cls(name=name, **{**values, **options})


class _Chunk:
    """One put's copy of one column; its bytes count until its last row is gone."""

    __slots__ = ("buf", "live", "nbytes", "offsets")

    def __init__(self, buf: torch.Tensor, offsets: torch.Tensor | None) -> None:
        self.buf = buf  # dense: [B, *inner]; jagged/object: [sum(L), *inner]
        self.offsets = offsets  # jagged/object: row i is buf[offsets[i]:offsets[i + 1]]
        self.nbytes = buf.numel() * buf.element_size()
        self.live = buf.shape[0] if offsets is None else offsets.numel() - 1


class _Partition:
    """Rows as columns, not objects: each live key has a slot, and each field an array over slots of
    the put (block, by number) holding its newest value and the row in that put. A batch of 64K rows
    would otherwise be 64K objects for the garbage collector to walk again and again, and to visit
    one by one on every get and clear."""

    __slots__ = ("blocks", "cols", "free", "next_block", "rows", "schema", "slots", "tagged")

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}  # live key -> slot
        self.schema: dict[str, FieldSchema] = {}
        self.cols: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # field -> (block number, row) per slot
        self.blocks: dict[int, dict[str, _Chunk]] = {}  # put (by number) -> its chunks some row still reads
        self.next_block = 0
        self.slots = 0  # slots handed out
        self.free: list[int] = []  # slots of cleared keys, handed out again
        self.tagged: list[tuple[np.ndarray, tuple[dict[str, Any], ...]]] = []  # (slot per row, tags) per put

    def slots_of(self, keys: Sequence[str]) -> np.ndarray:
        """The slot of each of ``keys`` (distinct), new keys getting free or new ones."""
        get = self.rows.get
        slots = np.array([get(k, NONE) for k in keys], dtype=np.int64)
        fresh = np.flatnonzero(slots == NONE)
        if len(fresh):
            reuse = min(len(fresh), len(self.free))
            taken = self.free[len(self.free) - reuse :]
            del self.free[len(self.free) - reuse :]
            new = np.concatenate(
                (np.array(taken, dtype=np.int64), np.arange(self.slots, self.slots + len(fresh) - reuse))
            )
            self.slots += len(fresh) - reuse
            slots[fresh] = new
            self.rows.update(zip([keys[i] for i in fresh.tolist()], new.tolist(), strict=True))
            for name, (chunk, row) in self.cols.items():
                if len(chunk) < self.slots:  # grow every field's columns (doubling)
                    self.cols[name] = (
                        grown(chunk, max(self.slots, 2 * len(chunk))),
                        grown(row, max(self.slots, 2 * len(row))),
                    )
        return slots

    def superseded(self, slots: np.ndarray, fields: Iterable[str]) -> list[tuple[_Chunk, int]]:
        """The chunks rows ``slots`` read ``fields`` from, each with how many of those rows."""
        out: list[tuple[_Chunk, int]] = []
        for f in fields:
            cols = self.cols.get(f)
            if cols is not None and len(slots):
                blocks = cols[0][slots]
                numbers, counts = np.unique(blocks[blocks != NONE], return_counts=True)
                out += [(self.blocks[b][f], c) for b, c in zip(numbers.tolist(), counts.tolist(), strict=True)]
        return out

    def drop(self, slots: np.ndarray, fields: Iterable[str]) -> int:
        """Rows ``slots`` no longer read ``fields``; returns the bytes of chunks no row reads any more."""
        freed = 0
        for f in fields:
            cols = self.cols.get(f)
            if cols is None or not len(slots):
                continue
            blocks = cols[0][slots]
            numbers, counts = np.unique(blocks[blocks != NONE], return_counts=True)
            for b, n in zip(numbers.tolist(), counts.tolist(), strict=True):
                chunks = self.blocks[b]
                chunk = chunks[f]
                chunk.live -= n
                if chunk.live == 0:
                    freed += chunk.nbytes
                    del chunks[f]  # releases the buffer
                    if not chunks:
                        del self.blocks[b]
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

    def listing(self) -> dict[str, dict[str, Any]]:
        """Every live key with its tags (merged over the puts that wrote it, in order)."""
        return merged_tags(self.tagged, self.rows)

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        cols = self.cols.get(name)
        if cols is None:
            size = max(self.slots, 1024)
            cols = self.cols[name] = (np.full(size, NONE, dtype=np.int64), np.zeros(size, dtype=np.int64))
        return cols


def _stored_copy(col: Column, pool: BufferPool, offsets: dict[int, torch.Tensor]) -> _Chunk:
    """Copy a column once into pooled memory (columns that share an offsets tensor share its copy)."""
    values = col.values
    buf = pool.tensor(tuple(values.shape), values.dtype)
    buf.copy_(values)
    if col.offsets is None:
        return _Chunk(buf, None)
    own = offsets.get(id(col.offsets))
    if own is None:
        own = offsets[id(col.offsets)] = col.offsets.clone()
    return _Chunk(buf, own)


@dataclass(frozen=True, slots=True, eq=False)
class _Rows:
    """Rows read from one put, in get order: their indices in it, grouped into runs of consecutive
    rows (``first[k]`` to ``last[k]`` inclusive). One run is one copy per field."""

    idx: np.ndarray
    first: np.ndarray
    last: np.ndarray

    @classmethod
    def of(cls, idx: np.ndarray) -> _Rows:
        if len(idx) and idx[-1] - idx[0] == len(idx) - 1 and (len(idx) < 3 or bool((np.diff(idx) == 1).all())):
            return cls(idx, idx[:1], idx[-1:])
        cut = np.flatnonzero(idx[1:] != idx[:-1] + 1) + 1
        return cls(idx, idx[np.concatenate(([0], cut))], idx[np.concatenate((cut - 1, [len(idx) - 1]))])


Piece = tuple[_Chunk, _Rows]  # rows of one put read from its chunk of a field


def _block_runs(blocks: np.ndarray, rows: np.ndarray) -> list[tuple[int, _Rows]]:
    """Consecutive rows of a get read from one put (block number): one vectorized gather each."""
    cut = (np.flatnonzero(blocks[1:] != blocks[:-1]) + 1).tolist()
    bounds = [0, *cut, len(blocks)]
    return [(int(blocks[a]), _Rows.of(rows[a:b])) for a, b in itertools.pairwise(bounds)]


def _spans(schema: FieldSchema, chunk: _Chunk, rows: _Rows) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of ``rows`` starts in the chunk's buffer, and its length (leading-dim units)."""
    if schema.kind == "dense":
        return rows.first, rows.last - rows.first + 1
    assert chunk.offsets is not None
    offsets = chunk.offsets.numpy()
    first = offsets[rows.first]
    return first, offsets[rows.last + 1] - first


def _lengths(chunk: _Chunk, rows: _Rows) -> np.ndarray:
    """The length of each of ``rows`` (jagged and object fields)."""
    assert chunk.offsets is not None
    offsets: np.ndarray = chunk.offsets.numpy()
    if len(rows.first) == 1:
        return np.diff(offsets[int(rows.first[0]) : int(rows.last[0]) + 2])
    lengths: np.ndarray = offsets[rows.idx + 1] - offsets[rows.idx]
    return lengths


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _assemble(
    schemas: Mapping[str, FieldSchema], pieces: Mapping[str, list[Piece]], fields: Sequence[str]
) -> dict[str, Column]:
    """Copy each field's rows back to back into memory the caller owns: fields of 1 MiB or more
    share one pooled buffer (:meth:`BufferPool.carve`), smaller ones get their own. Fields read from
    the same stored offsets tensors, over the same rows, share one offsets tensor, hence one ragged
    dim."""
    spans = {f: [_spans(schemas[f], chunk, rows) for chunk, rows in pieces[f]] for f in fields}
    lengths = {f: [int(ln.sum()) for _, ln in spans[f]] for f in fields}
    nbytes = {f: sum(lengths[f]) * schemas[f].row_nbytes for f in fields}
    carved = default_pool().carve(nbytes)
    layouts: dict[tuple[Any, ...], torch.Tensor] = {}
    out: dict[str, Column] = {}
    for f in fields:
        schema = schemas[f]
        unit = schema.row_nbytes
        raw = carved.get(f)
        if raw is None:
            raw = torch.empty(nbytes[f], dtype=torch.uint8)
        at = 0
        for (chunk, _), (first, length), n in zip(pieces[f], spans[f], lengths[f], strict=True):
            if n:
                gather_bytes(raw[at : at + n * unit], _as_bytes(chunk.buf), first * unit, length * unit)
            at += n * unit
        values = schema.view_rows(raw, sum(lengths[f]))
        if schema.kind == "dense":
            out[f] = Column(schema, values)
            continue
        layout = tuple((id(chunk.offsets), id(rows)) for chunk, rows in pieces[f])
        offsets = layouts.get(layout)
        if offsets is None:
            parts = [_lengths(chunk, rows) for chunk, rows in pieces[f]]
            lens = parts[0] if len(parts) == 1 else np.concatenate(parts)
            offsets = layouts[layout] = offsets_from_lengths(torch.from_numpy(lens))
        out[f] = Column(schema, values, offsets)
    return out


class MemoryStore(KVStore):
    """The memory adapter's store. See the module docstring."""

    def __init__(self, config: MemoryConfig | None = None) -> None:
        cfg = config or MemoryConfig()
        for name in ("capacity_bytes", "capacity_rows"):
            value = getattr(cfg, name)
            if value is not None and value < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {value}")
        self.config = cfg
        self._lock = threading.Lock()
        self._parts: dict[str, _Partition] = {}
        self._rows = 0
        self._bytes = 0
        self._pool = BufferPool(min(cfg.capacity_bytes or (2 << 30), 2 << 30))
        self._caps = Capabilities(backend="memory", cross_process=False, cross_node=False, zero_copy=True)

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def used_rows(self) -> int:
        return self._rows

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
        chunks = {field: _stored_copy(col, self._pool, shared) for field, col in columns.items()}
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            known = part.schema if part is not None else {}
            for field, col in columns.items():
                if field in known:
                    check_compatible(partition_id, field, known[field], col.schema)
            rows = part.rows if part is not None else {}
            get = rows.get
            held = np.array([s for s in (get(k) for k in keys) if s is not None], dtype=np.int64)
            new_rows = len(keys) - len(held)
            if cfg.capacity_rows is not None and self._rows + new_rows > cfg.capacity_rows:
                raise CapacityExceeded(
                    f"memory store holds {self._rows} of capacity_rows={cfg.capacity_rows} rows; "
                    f"this put adds {new_rows}. Clear consumed rows (kv_clear) or raise capacity_rows"
                )
            if cfg.capacity_bytes is not None:
                freed = 0 if part is None else sum(c.nbytes for c, n in part.superseded(held, columns) if n == c.live)
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
            slots = part.slots_of(keys)
            number = part.next_block
            part.next_block += 1
            part.blocks[number] = chunks
            at = np.arange(len(keys), dtype=np.int64)
            for field in columns:
                block, row = part.column(field)
                block[slots] = number
                row[slots] = at
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
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            rows: dict[str, int] = part.rows if part is not None else {}
            get = rows.get
            found = [get(k, NONE) for k in keys]
            slots = np.array(found, dtype=np.int64)
            if part is None or (slots == NONE).any():
                raise missing_rows_error(partition_id, [k for k, s in zip(keys, found, strict=True) if s == NONE])
            per_field: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            missing_fields: dict[str, list[str]] = {}
            for f in fields:
                cols = part.cols.get(f)
                if cols is None:
                    missing_fields[f] = list(keys)
                    continue
                blocks = cols[0][slots]
                absent = np.flatnonzero(blocks == NONE)
                if len(absent):
                    missing_fields[f] = [keys[j] for j in absent.tolist()]
                per_field[f] = (blocks, cols[1][slots])
            if missing_fields:
                raise missing_rows_error(partition_id, (), missing_fields)
            schemas = {f: part.schema[f] for f in fields}
            alike: list[tuple[np.ndarray, np.ndarray, list[tuple[int, _Rows]]]] = []
            pieces: dict[str, list[Piece]] = {}
            for f in fields:  # fields read alike (the common case: all of them) group their rows once
                blocks, idx = per_field[f]
                runs = next((r for b, i, r in alike if np.array_equal(b, blocks) and np.array_equal(i, idx)), None)
                if runs is None:
                    runs = _block_runs(blocks, idx)
                    alike.append((blocks, idx, runs))
                pieces[f] = [(part.blocks[b][f], rows) for b, rows in runs]
        finally:
            self._lock.release()
        # Copy outside the lock: a stored buffer is never written after its put publishes it, and
        # ``pieces`` holds the chunks alive even if a concurrent put or clear drops them.
        return _assemble(schemas, pieces, fields)

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        self._acquire(timeout_s)
        try:
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
            pids = [partition_id] if partition_id is not None else list(self._parts)
            return {pid: self._parts[pid].listing() for pid in pids if pid in self._parts}
        finally:
            self._lock.release()

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

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        self.target.clear(partition_id, keys, timeout_s=timeout_s)

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        return self.target.list(partition_id, timeout_s=timeout_s)

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
        cfg = url_or_config
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
