"""The data path of TransferQueue's MooncakeStore backend, done by us with TQ's own store handle.

TQ keeps one Mooncake object per (row, field) under the key ``"{global_index}@{field}"`` and lets the
controller record dtypes and per-row shapes. We keep one object per (row, field) and the controller's
records, but name each object ``"{global_index}:{stamp}@{field}"``, where the stamp is the row key's
hash (:func:`object_name`), and move the bytes ourselves, because TQ's path cannot serve dataplane's
contract:

* TQ hands a cleared row's global index to the next new key, and a writer or reader that took the
  index from the controller before the clear still uses it after. Named by index alone, a reader
  of the cleared key reads the new key's bytes, and a late writer of the cleared key writes over
  the new key's fields. Named by index and key, every object says whose it is: a reader asks only
  for its own key's objects (another key's are simply not found, -704, and the get reads the rows'
  metadata again), and a late writer's objects are its own key's, never read as another's. No
  extra object, byte or round trip; TransferQueue's own readers cannot read these rows.
* Mooncake refuses zero-byte objects (``-600``, and TQ then retries for 3 s): a jagged row of length
  0 could not be stored. We never store zero-byte values; their shape, recorded by the controller
  like every other row's, is enough to rebuild them.
* TQ retries every failed key three times with 1 s sleeps and reports codes only in a message; we
  map codes ourselves (``-200`` is :class:`~dataplane.errors.CapacityExceeded`).
* TQ's get runs the blocking Mooncake call inside its event loop and copies every row into a new
  nested tensor. We read each field straight into one buffer per field (``batch_get_into`` at row
  offsets): no copy after the transfer, and the loop stays free.

Every function here blocks; callers run them in an executor thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from dataplane.adapters.transfer_queue._layout import RowsChanged
from dataplane.codec.jagged import offsets_from_lengths
from dataplane.codec.wire import Column
from dataplane.errors import BackendUnavailable, CapacityExceeded, DataPlaneError, KeyNotFound
from dataplane.schema import FieldSchema

__all__ = ["MooncakeData", "ReadPlan", "object_name"]

log = logging.getLogger(__name__)

CHUNK_KEYS = 400  # keys per batch call (large cross-process batches fail in Mooncake's TCP lanes)
_THREADS = 4
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()

_NAMES = {
    -200: "no space left in the Mooncake pool (NO_AVAILABLE_HANDLE)",
    -600: "invalid parameters",
    -703: "replica not ready",
    -704: "object not found",
    -706: "object has a lease",
    -707: "lease expired",
    -800: "transfer failed",
    -900: "RPC to the master failed",
    -901: "RPC to the master timed out",
}


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="dataplane-tq-mooncake")
        return _pool


# A row rewritten or removed by another process while it was read: gone (-704), being written (-703),
# or now of another size than the controller recorded (-600 for a buffer too small, or a short read).
_CHANGED = (-600, -703, -704)
_RETRIES = 4


def object_name(global_index: int, stamp: int, field: str) -> str:
    """The Mooncake object holding ``field`` of the row at ``global_index`` whose key hashes to
    ``stamp``."""
    return _prefixes([global_index], [stamp])[0] + field


def _prefixes(global_indexes: Sequence[int], stamps: Sequence[int]) -> list[str]:
    """Each row's object names up to the field (formatted once per row, not per row and field)."""
    return [f"{gi}:{st & 0xFFFFFFFFFFFFFFFF:016x}@" for gi, st in zip(global_indexes, stamps, strict=True)]


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What to read for one field: its schema and, for jagged/object fields, each row's length."""

    schema: FieldSchema
    lengths: Sequence[int] | None = None


class MooncakeData:
    """Put / get / remove of columns through TQ's ``MooncakeStoreClient`` (its ``_store``)."""

    def __init__(self, storage_client: Any) -> None:
        self._store = storage_client._store
        self._config = storage_client.replica_config
        if self._store is None:
            raise BackendUnavailable("the Mooncake store client of TransferQueue is closed")

    # ------------------------------------------------------------------ helpers
    def _register(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        return nbytes > 0 and self._store.register_buffer(t.data_ptr(), nbytes) == 0

    def _batches(self, fn: Any, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        spans = [(i, min(i + CHUNK_KEYS, len(keys))) for i in range(0, len(keys), CHUNK_KEYS)]
        if len(spans) <= 1:
            return list(fn(keys, ptrs, sizes)) if keys else []
        parts = _executor().map(lambda s: list(fn(keys[s[0] : s[1]], ptrs[s[0] : s[1]], sizes[s[0] : s[1]])), spans)
        return [code for part in parts for code in part]

    @staticmethod
    def _raise(op: str, keys: list[str], codes: list[int]) -> None:
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c < 0]
        if not bad:
            return
        first_key, first = bad[0]
        detail = f"{len(bad)} of {len(keys)} Mooncake {op}s failed, e.g. {first_key!r}: {first} ({_NAMES.get(first, 'error')})"
        if any(c == -200 for _, c in bad):
            raise CapacityExceeded(
                f"{detail}; the Mooncake pool is full: clear consumed rows (kv_clear) or raise segment_bytes"
            )
        if op == "get" and all(c == -704 for _, c in bad):
            raise KeyNotFound(f"{detail}; the rows were removed while being read (a concurrent kv_clear?)")
        raise BackendUnavailable(f"{detail}; is the mooncake_master or the segment owner (the TQ owner) alive?")

    # ------------------------------------------------------------------ operations
    def put(self, global_indexes: Sequence[int], stamps: Sequence[int], columns: Mapping[str, Column]) -> None:
        """Write ``columns`` to the rows at ``global_indexes`` whose keys hash to ``stamps``."""
        keys: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        held: list[torch.Tensor] = []
        registered: list[int] = []
        rows = _prefixes(global_indexes, stamps)
        try:
            for field, col in columns.items():
                values = col.values.contiguous()
                held.append(values)
                if self._register(values):
                    registered.append(values.data_ptr())
                es = values.element_size() * col.schema.row_numel  # bytes per row (dense) or per token
                cuts = list(range(len(global_indexes) + 1)) if col.offsets is None else col.offsets.tolist()
                base = values.data_ptr()
                for row, a, b in zip(rows, cuts[:-1], cuts[1:], strict=True):
                    if b > a:  # Mooncake refuses empty objects; a zero-length row needs no bytes
                        keys.append(row + field)
                        ptrs.append(base + a * es)
                        sizes.append((b - a) * es)
            codes = self._batches(
                lambda k, p, s: self._store.batch_upsert_from(k, p, s, config=self._config), keys, ptrs, sizes
            )
            for attempt in range(_RETRIES):  # another process upserting the same row right now: after it
                again = [j for j, c in enumerate(codes) if c < 0 and c != -200]
                if not again:
                    break
                time.sleep(0.005 * 2**attempt)
                redo = self._batches(
                    lambda k, p, s: self._store.batch_upsert_from(k, p, s, config=self._config),
                    [keys[j] for j in again],
                    [ptrs[j] for j in again],
                    [sizes[j] for j in again],
                )
                for j, c in zip(again, redo, strict=True):
                    codes[j] = c
            self._raise("put", keys, codes)
        finally:
            for ptr in registered:
                self._store.unregister_buffer(ptr)

    def get(
        self, global_indexes: Sequence[int], stamps: Sequence[int], plans: Mapping[str, ReadPlan]
    ) -> dict[str, Column]:
        """Read ``plans``' fields of the rows at ``global_indexes`` whose keys hash to ``stamps``;
        raises :class:`RowsChanged` when a row is gone or changed while read (its index may now hold
        another key's row, whose objects have other names)."""
        n = len(global_indexes)
        out: dict[str, Column] = {}
        keys: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        registered: list[int] = []
        rows = _prefixes(global_indexes, stamps)
        try:
            for field, plan in plans.items():
                schema = plan.schema
                es = schema.row_nbytes
                if plan.lengths is None:
                    buf = torch.empty((n, *schema.inner_shape), dtype=schema.dtype)
                    cuts = list(range(n + 1))
                    out[field] = Column(schema, buf)
                else:
                    offsets = offsets_from_lengths(plan.lengths)
                    cuts = offsets.tolist()
                    buf = torch.empty((cuts[-1], *schema.inner_shape), dtype=schema.dtype)
                    out[field] = Column(schema, buf, offsets)
                if self._register(buf):
                    registered.append(buf.data_ptr())
                base = buf.data_ptr()
                for row, a, b in zip(rows, cuts[:-1], cuts[1:], strict=True):
                    if b > a:
                        keys.append(row + field)
                        ptrs.append(base + a * es)
                        sizes.append((b - a) * es)
            got = self._batches(self._store.batch_get_into, keys, ptrs, sizes)
            changed = [k for k, g, s in zip(keys, got, sizes, strict=True) if g in _CHANGED or (g >= 0 and g != s)]
            if changed:
                raise RowsChanged(f"{len(changed)} of {len(keys)} rows changed while being read, e.g. {changed[0]!r}")
            self._raise("get", keys, got)
            short = [(k, g, s) for k, g, s in zip(keys, got, sizes, strict=True) if g != s]
            if short:
                k, g, s = short[0]
                raise DataPlaneError(
                    f"Mooncake returned {g} bytes for {k!r} where its recorded shape needs {s}; the row was "
                    "rewritten while being read, or written by something other than dataplane"
                )
            return out
        finally:
            for ptr in registered:
                self._store.unregister_buffer(ptr)

    def remove(self, global_indexes: Sequence[int], stamps: Sequence[int], fields: Sequence[str]) -> None:
        """Remove ``fields``' objects of the rows at ``global_indexes`` whose keys hash to ``stamps``."""
        rows = _prefixes(global_indexes, stamps)
        keys = [row + f for f in fields for row in rows]
        if not keys:
            return
        codes: list[int] = []
        for i in range(0, len(keys), CHUNK_KEYS):
            codes.extend(self._store.batch_remove(keys[i : i + CHUNK_KEYS], force=True))
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, -704)]
        if failed:
            log.warning("dataplane: %d Mooncake removes failed, e.g. %r: %s", len(failed), *failed[0])
