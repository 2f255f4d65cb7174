"""How a shard reaches a GPU in a fetch: through the process's pinned pool
(:mod:`dataplane.worker.pinned`), chunked and overlapped on a side stream.

Two paths, the first where the store allows it:

* **Read into the pool** (:func:`read_columns`): a store with the
  :class:`~dataplane.adapters.read_into.ReadsInto` surface (``memory://``) plans the get, and the
  pool's chunks are filled straight from the store's memory, window by window, each chunk's copy to
  the GPU overlapping the next window's read: the shard's host bytes are copied once. A store whose
  read says ``device_direct`` (GPU-direct transfers; none shipped) is handed the GPU tensors
  themselves, without the pool.
* **Read, then stage** (:func:`move_columns`): every other store's get lands in host memory of its
  own (``mooncake://`` over shared memory: memory only its store server writes, whole objects at a
  time), and the columns are copied from there through the pool. The read comes first, whole:
  reading the shard in groups of rows overlapped with their copies was measured slower on one H100
  (``benchmarks/reports/2026-12-06_1xH100_gpu_path_rowgroups.md``).

>>> import torch
>>> from dataplane.codec.wire import Column, FieldSchema
>>> col = Column(FieldSchema(kind="dense", dtype=torch.int64, inner_shape=()), torch.arange(3))
>>> move_columns({"x": col}, torch.device("cpu"), "always")["x"].values.tolist()
[0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from dataplane.adapters.read_into import ReadsInto
from dataplane.codec.wire import Column, decode_columns
from dataplane.errors import DataPlaneError
from dataplane.meta import KVBatchMeta
from dataplane.worker.pinned import process_pool

__all__ = ["PinnedMode", "direct_store", "move_columns", "read_columns"]

PinnedMode = Literal["auto", "always", "never"]


def move_columns(cols: Mapping[str, Column], device: torch.device, pinned: PinnedMode = "auto") -> dict[str, Column]:
    """``cols`` on ``device`` (object columns stay: they decode on the CPU). Host to CUDA goes through
    the process's pinned pool (:func:`~dataplane.worker.pinned.process_pool`): chunked, overlapped,
    the current stream made to wait, no device synchronize. ``pinned="never"``: plain ``.to()``;
    ``"always"``: every host column through the pool, a CPU target too (what CPU tests exercise)."""
    moving = [
        f
        for f, c in cols.items()
        if c.schema.kind != "object" and (c.values.device != device or (pinned == "always" and device.type == "cpu"))
    ]
    if not moving:
        return dict(cols)
    tensors: list[torch.Tensor] = []
    for f in moving:
        offsets = cols[f].offsets
        tensors += [cols[f].values] if offsets is None else [cols[f].values, offsets]
    on_host = all(t.device.type == "cpu" for t in tensors)
    if pinned != "never" and on_host and (device.type == "cuda" or pinned == "always"):
        moved = iter(process_pool().to_device(tensors, device))
    else:
        moved = iter([t.to(device) for t in tensors])
    out = dict(cols)
    for f in moving:
        values = next(moved)
        out[f] = Column(cols[f].schema, values, None if cols[f].offsets is None else next(moved))
    return out


def direct_store(client: Any, meta: KVBatchMeta, device: torch.device | None, pinned: PinnedMode) -> ReadsInto | None:
    """The store of ``client`` when a fetch of ``meta`` to ``device`` can read into the pinned pool
    (:func:`read_columns`), else None: a client without such a store (another adapter, or one wrapped
    by a metrics or logging client, whose get then stays observed), a closed one, a meta of another
    deployment (``kv_batch_get`` raises the typed error and its advice), a plain-copy mode
    (``pinned="never"``) or a host target outside ``pinned="always"``."""
    if device is None or pinned == "never" or (device.type != "cuda" and pinned != "always"):
        return None
    if not meta.keys:  # kv_batch_get's own checks and errors for an empty meta
        return None
    store = getattr(client, "store", None)
    if not isinstance(store, ReadsInto) or getattr(client, "closed", True):
        return None
    ours = getattr(store, "deployment_id", "")
    if meta.deployment and ours and meta.deployment != ours:
        return None
    return store


def read_columns(
    client: Any, store: ReadsInto, meta: KVBatchMeta, fields: Sequence[str], device: torch.device
) -> tuple[dict[str, Column], dict[str, Any]]:
    """Fields of ``meta``'s rows read into the pinned pool (see the module docstring): tensor fields
    as columns on ``device``; object fields decoded on the CPU as ``kv_batch_get`` decodes them
    (pickle only for the client's ``pickle_fields``).

    Raises what the store's get raises (``KeyNotFound`` before any byte moves); a failure midway
    returns every pinned buffer (:meth:`~dataplane.worker.pinned.PinnedPool.fill`).
    """
    timeout_s = float(getattr(client, "timeout_s", 60.0))
    read = store.begin_read_into(meta.partition_id, list(meta.keys), list(fields), meta=meta, timeout_s=timeout_s)
    layout = read.columns
    objects: dict[str, Any] = {}
    names: list[str] = []
    dsts: list[torch.Tensor] = []
    offsets: dict[int, torch.Tensor] = {}  # host offsets by id: fields of equal lengths share one tensor
    for f in fields:
        col = layout.get(f)
        if col is None or col.num_rows != meta.size:
            got = "no column" if col is None else f"{col.num_rows} rows"
            raise DataPlaneError(
                f"the store planned {got} for field {f!r} of {meta.size} keys; this is an adapter bug, please report it"
            )
        if col.schema.kind == "object":
            raw = torch.empty(col.values.numel(), dtype=torch.uint8)
            if raw.numel():
                read.read_into(f, 0, raw)
            pickle_fields: frozenset[str] = getattr(client, "pickle_fields", frozenset())
            objects[f] = decode_columns(
                {f: Column(col.schema, raw, col.offsets)}, meta.size, pickle_fields=pickle_fields
            ).get(f)
            continue
        if col.offsets is not None:
            offsets.setdefault(id(col.offsets), col.offsets)
        names.append(f)
        dsts.append(torch.empty(col.values.shape, dtype=col.values.dtype, device=device))
    pool = process_pool()
    moved = dict(zip(offsets, pool.to_device(list(offsets.values()), device), strict=True))
    if read.device_direct:  # the store writes device memory itself: no staging
        if device.type == "cuda":  # the destinations may still be used by work queued on the caller's stream
            torch.cuda.current_stream(device).synchronize()
        for f, dst in zip(names, dsts, strict=True):
            if dst.numel():
                read.read_into(f, 0, dst.reshape(-1).view(torch.uint8))
    else:
        pool.fill(dsts, lambda i, start, window: read.read_into(names[i], start, window))
    cols: dict[str, Column] = {}
    for f, dst in zip(names, dsts, strict=True):
        host = layout[f].offsets
        cols[f] = Column(layout[f].schema, dst, None if host is None else moved[id(host)])
    return cols, objects
