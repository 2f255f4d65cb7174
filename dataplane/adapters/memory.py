"""``memory://``: an in-process, thread-safe, capacity-bounded store.

The default for one process, for tests, and the benchmark's baseline. A put copies each column once
into pooled memory (the caller may mutate its tensors afterwards); a get copies the requested rows
once into pooled memory the caller owns. Locks are held only for bookkeeping, never for copies:
stored tensors are never mutated in place, a re-write swaps in new ones.

``memory://`` is a private store; ``memory://NAME`` is shared by every client in the process that
names it, and lives until the last of them closes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

from dataplane.bufpool import BufferPool, default_pool
from dataplane.client import Capabilities, Listing
from dataplane.codec.jagged import offsets_from_lengths
from dataplane.codec.wire import Column
from dataplane.errors import CapacityExceeded, DataPlaneTimeout, InvalidArgument, missing_rows_error
from dataplane.meta import KVBatchMeta
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
                values[key] = int(float(raw))
            elif key == "timeout_s":
                values[key] = float(raw)
            elif key == "pickle_fields":
                values[key] = tuple(x for x in raw.split(",") if x)
            else:
                raise InvalidArgument(f"unknown memory:// option {key!r}; known: {sorted(cls.__dataclass_fields__)}")
        name = (parsed.netloc + parsed.path).strip("/") or None
        return cls(name=name, **{**values, **options})


class _Chunk:
    """One put's copy of one column; its bytes count until its last row is gone."""

    __slots__ = ("live", "nbytes")

    def __init__(self, nbytes: int, live: int) -> None:
        self.nbytes = nbytes
        self.live = live


class _Cell:
    __slots__ = ("chunk", "data")

    def __init__(self, data: torch.Tensor, chunk: _Chunk) -> None:
        self.data = data
        self.chunk = chunk


class _Row:
    __slots__ = ("cells", "tags")

    def __init__(self) -> None:
        self.cells: dict[str, _Cell] = {}
        self.tags: dict[str, Any] = {}


class _Partition:
    __slots__ = ("rows", "schema")

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.schema: dict[str, FieldSchema] = {}


def _stored_copy(col: Column, pool: BufferPool) -> tuple[list[torch.Tensor], _Chunk]:
    """Copy a column once into pooled memory; return per-row views and its chunk."""
    values = col.values
    buf = pool.tensor(tuple(values.shape), values.dtype)
    buf.copy_(values)
    if col.offsets is None:
        rows = list(buf.unbind(0))
    else:
        lengths = (col.offsets[1:] - col.offsets[:-1]).tolist()
        rows = list(torch.split(buf, lengths, dim=0))
    return rows, _Chunk(buf.numel() * buf.element_size(), len(rows))


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
        copies = {field: _stored_copy(col, self._pool) for field, col in columns.items()}
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            known = part.schema if part is not None else {}
            for field, col in columns.items():
                if field in known:
                    check_compatible(partition_id, field, known[field], col.schema)
            rows = part.rows if part is not None else {}
            new_rows = sum(1 for k in keys if k not in rows)
            freed, dropping = 0, Counter[int]()
            for k in keys:
                row = rows.get(k)
                if row is None:
                    continue
                for field in columns:
                    cell = row.cells.get(field)
                    if cell is not None:
                        dropping[id(cell.chunk)] += 1
                        if dropping[id(cell.chunk)] == cell.chunk.live:
                            freed += cell.chunk.nbytes
            if cfg.capacity_rows is not None and self._rows + new_rows > cfg.capacity_rows:
                raise CapacityExceeded(
                    f"memory store holds {self._rows} of capacity_rows={cfg.capacity_rows} rows; "
                    f"this put adds {new_rows}. Clear consumed rows (kv_clear) or raise capacity_rows"
                )
            if cfg.capacity_bytes is not None and self._bytes - freed + incoming > cfg.capacity_bytes:
                raise CapacityExceeded(
                    f"memory store holds {self._bytes} of capacity_bytes={cfg.capacity_bytes} bytes; this put needs "
                    f"{incoming - freed} more. Clear consumed rows (kv_clear) or raise capacity_bytes"
                )
            # Validated: apply. Nothing below can fail.
            if part is None:
                part = self._parts[partition_id] = _Partition()
            for field, col in columns.items():
                part.schema.setdefault(field, col.schema)
            for i, k in enumerate(keys):
                row = part.rows.get(k)
                if row is None:
                    row = part.rows[k] = _Row()
                for field, (views, chunk) in copies.items():
                    old = row.cells.get(field)
                    if old is not None:
                        self._release(old)
                    row.cells[field] = _Cell(views[i], chunk)
                if tags is not None:
                    row.tags.update(tags[i])
            self._rows += new_rows
            self._bytes += sum(chunk.nbytes for _, chunk in copies.values())
        finally:
            self._lock.release()
        return None

    def _release(self, cell: _Cell) -> None:
        cell.chunk.live -= 1
        if cell.chunk.live == 0:
            self._bytes -= cell.chunk.nbytes

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
            rows = part.rows if part is not None else {}
            missing_keys = [k for k in keys if k not in rows]
            missing_fields: dict[str, list[str]] = {}
            gathered: dict[str, list[torch.Tensor]] = {f: [] for f in fields}
            if not missing_keys:
                for k in keys:
                    cells = rows[k].cells
                    for f in fields:
                        cell = cells.get(f)
                        if cell is None:
                            missing_fields.setdefault(f, []).append(k)
                        else:
                            gathered[f].append(cell.data)
            if missing_keys or missing_fields:
                raise missing_rows_error(partition_id, missing_keys, missing_fields)
            assert part is not None
            schemas = {f: part.schema[f] for f in fields}
        finally:
            self._lock.release()
        # Stored tensors are immutable once published, so copying outside the lock is safe.
        return {f: self._assemble(schemas[f], gathered[f]) for f in fields}

    @staticmethod
    def _assemble(schema: FieldSchema, cells: list[torch.Tensor]) -> Column:
        pool = default_pool()
        if schema.kind == "dense":
            out = pool.tensor((len(cells), *schema.inner_shape), schema.dtype)
            torch.stack(cells, out=out)
            return Column(schema, out)
        lengths = [c.shape[0] for c in cells]
        values = pool.tensor((sum(lengths), *schema.inner_shape), schema.dtype)
        torch.cat(cells, out=values)
        return Column(schema, values, offsets_from_lengths(lengths))

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        self._acquire(timeout_s)
        try:
            part = self._parts.get(partition_id)
            if part is None:
                return
            doomed = list(part.rows) if keys is None else [k for k in keys if k in part.rows]
            for k in doomed:
                for cell in part.rows.pop(k).cells.values():
                    self._release(cell)
            self._rows -= len(doomed)
            if not part.rows:
                del self._parts[partition_id]
        finally:
            self._lock.release()

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        self._acquire(timeout_s)
        try:
            pids = [partition_id] if partition_id is not None else list(self._parts)
            return {
                pid: {k: dict(row.tags) for k, row in self._parts[pid].rows.items()}
                for pid in pids
                if pid in self._parts
            }
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
