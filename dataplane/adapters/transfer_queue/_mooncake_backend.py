"""The data path of TransferQueue's MooncakeStore backend, done by us with TQ's own store handle.

TQ keeps one Mooncake object per (row, field) under the key ``"{global_index}@{field}"`` and lets the
controller record dtypes and per-row shapes. We keep one object per (row, field) and the controller's
records, but every put writes new objects, named ``"{global_index}:{token}@{field}"``
(:func:`object_name`). A row's *token* is its key's hash (the stamp) and a random 48-bit version
drawn for the put; the controller records it per row and field in the same request that records
the rows' shapes (TQ's ``custom_backend_meta``). We move the bytes ourselves, because TQ's path
cannot serve dataplane's contract:

* TQ overwrites a row's objects in place, so a reader can get part of one put's bytes and part of
  another's (a torn row), and a row's shapes from one put and its bytes from another. Here an
  object is never written twice: a reader reads the tokens the controller named together with
  the shapes, so it gets each field of one put, whole, and the fields a put wrote together from
  that put. The objects a put replaces are removed after it is recorded.
* Removing an object frees its memory at once (removals are forced: every read leaves a 10 s lease
  that would block a plain one), and Mooncake can hand that memory to another put while a reader
  is still transferring from it. So a get keeps what it read only if every object it read still
  exists after the read (:meth:`MooncakeData.get`): a token is never written again, so an object
  still there was never freed under the read.
* TQ hands a cleared row's global index to the next new key, and a writer or reader that took the
  index before the clear still uses it after. A reader of the cleared key asks for the cleared
  row's tokens, which name no other row. A late writer of the cleared key writes objects and a
  record under its own key's stamp: another key's reader finds a token that is not its key's and
  reads the rows' metadata again (:func:`key_prefix`), never another key's bytes.
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
import os
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
from dataplane.errors import BackendUnavailable, CapacityExceeded, KeyNotFound
from dataplane.schema import FieldSchema

__all__ = ["MooncakeData", "ReadPlan", "Tokens", "key_prefix", "new_version", "object_name", "row_tokens", "token_of"]

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

Tokens = Mapping[str, str]
"""One row's objects: the token of each of its fields (TQ's ``custom_backend_meta`` of the row)."""


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="dataplane-tq-mooncake")
        return _pool


# A row removed while it was read: gone (-704), not written yet (-703), or of another size than the
# controller recorded (-600 for a buffer too small, or a short read: only a foreign writer does that).
_CHANGED = (-600, -703, -704, -707)
_UNCHECKED = -1_000_000  # a read whose existence check the master did not answer
_RETRIES = 4


def new_version() -> int:
    """A put's version: 48 random bits (the objects of two puts of one row never share a name)."""
    return int.from_bytes(os.urandom(6), "little")


def token_of(stamp: int, version: int) -> str:
    """The token of a row whose key hashes to ``stamp``, as the put of ``version`` wrote it."""
    return f"{stamp & 0xFFFFFFFFFFFFFFFF:016x}.{version:012x}"


def key_prefix(stamp: int) -> str:
    """How the tokens of a key that hashes to ``stamp`` begin."""
    return f"{stamp & 0xFFFFFFFFFFFFFFFF:016x}."


def object_name(global_index: int, token: str, field: str) -> str:
    """The Mooncake object holding ``field`` of the row at ``global_index`` under ``token``."""
    return f"{global_index}:{token}@{field}"


def row_tokens(backend_meta: Mapping[str, Any]) -> dict[str, str]:
    """The tokens a row's TQ ``custom_backend_meta`` records (fields written by something other
    than dataplane have none)."""
    return {f: t for f, t in backend_meta.items() if isinstance(t, str)}


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What to read for one field: its schema, each row's token and, for jagged/object fields,
    each row's length."""

    schema: FieldSchema
    tokens: Sequence[str]
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

    def _batches(self, fn: Any, *columns: list[Any]) -> list[int]:
        """``fn`` over ``columns`` (keys first) in chunks of :data:`CHUNK_KEYS`, concurrently."""
        keys = columns[0]
        spans = [(i, min(i + CHUNK_KEYS, len(keys))) for i in range(0, len(keys), CHUNK_KEYS)]
        if len(spans) <= 1:
            return list(fn(*columns)) if keys else []
        parts = _executor().map(lambda s: list(fn(*(c[s[0] : s[1]] for c in columns))), spans)
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
    def put(self, global_indexes: Sequence[int], tokens: Sequence[str], columns: Mapping[str, Column]) -> None:
        """Write ``columns`` to new objects of the rows at ``global_indexes``, named by ``tokens``."""
        keys: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        held: list[torch.Tensor] = []
        registered: list[int] = []
        rows = [object_name(gi, t, "") for gi, t in zip(global_indexes, tokens, strict=True)]
        upsert = self._upsert
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
            codes = self._batches(upsert, keys, ptrs, sizes)
            for attempt in range(_RETRIES):  # a transfer that failed on a busy peer: once more, a bit later
                again = [j for j, c in enumerate(codes) if c < 0 and c != -200]
                if not again:
                    break
                time.sleep(0.005 * 2**attempt)
                redo = self._batches(
                    upsert, [keys[j] for j in again], [ptrs[j] for j in again], [sizes[j] for j in again]
                )
                for j, c in zip(again, redo, strict=True):
                    codes[j] = c
            self._raise("put", keys, codes)
        finally:
            for ptr in registered:
                self._store.unregister_buffer(ptr)

    def _upsert(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        # an upsert, not a put: a retry of this put's own object replaces it (a put would keep it)
        return list(self._store.batch_upsert_from(keys, ptrs, sizes, config=self._config))

    def get(self, global_indexes: Sequence[int], plans: Mapping[str, ReadPlan]) -> dict[str, Column]:
        """Read ``plans``' fields of the rows at ``global_indexes``, each row's field under the token
        its plan names; raises :class:`RowsChanged` when an object is gone (a later put or a clear
        removed it) before or while it was read."""
        n = len(global_indexes)
        out: dict[str, Column] = {}
        keys: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        registered: list[int] = []
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
                suffix = "@" + field
                for gi, t, a, b in zip(global_indexes, plan.tokens, cuts[:-1], cuts[1:], strict=True):
                    if b > a:
                        keys.append(f"{gi}:{t}{suffix}")
                        ptrs.append(base + a * es)
                        sizes.append((b - a) * es)
            got = self._batches(self._read_checked, keys, ptrs, sizes)
            changed = [k for k, g, s in zip(keys, got, sizes, strict=True) if g in _CHANGED or (g >= 0 and g != s)]
            if changed:
                raise RowsChanged(f"{len(changed)} of {len(keys)} rows changed while being read, e.g. {changed[0]!r}")
            if any(g == _UNCHECKED for g in got):
                raise BackendUnavailable(
                    f"Mooncake could not say whether the {len(keys)} objects it just read still exist; is the "
                    "mooncake_master alive?"
                )
            self._raise("get", keys, got)
            return out
        finally:
            for ptr in registered:
                self._store.unregister_buffer(ptr)

    def _read_checked(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``batch_get_into``, then keep only what is still there: an object removed during or
        before the read counts as gone (``-704``). Every object still there after the read was never
        removed, so its memory never went to another put while it was read (a token's objects are
        never written twice). ``_UNCHECKED``: the master did not answer the check."""
        got = list(self._store.batch_get_into(keys, ptrs, sizes))
        if any(g < 0 for g in got):
            return got  # read again anyway
        there = self._store.batch_is_exist(keys)
        return [g if e == 1 else -704 if e == 0 else _UNCHECKED for g, e in zip(got, there, strict=True)]

    def remove(self, global_indexes: Sequence[int], tokens: Sequence[Tokens]) -> None:
        """Remove the objects ``tokens`` names for each row at ``global_indexes`` (forced: a read's
        lease must not keep a cleared or replaced row; :meth:`get` checks its reads for this)."""
        keys = [object_name(gi, t, f) for gi, row in zip(global_indexes, tokens, strict=True) for f, t in row.items()]
        if not keys:
            return
        codes: list[int] = []
        for i in range(0, len(keys), CHUNK_KEYS):
            codes.extend(self._store.batch_remove(keys[i : i + CHUNK_KEYS], force=True))
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, -704)]
        if failed:
            log.warning("dataplane: %d Mooncake removes failed, e.g. %r: %s", len(failed), *failed[0])
