"""How host data reaches a GPU in a fetch: every column through the process's pinned pool
(:mod:`dataplane.worker.pinned`), chunked and overlapped on a side stream.

The store read itself comes first, whole: reading the shard in groups of rows overlapped with their
copies was measured slower on one H100 (``mooncake://local`` 8.2 -> 1.6 GB/s, ``memory://`` no gain;
``benchmarks/reports/2026-12-06_1xH100_gpu_path.md``) and is not done.

>>> import torch
>>> from dataplane.codec.wire import Column, FieldSchema
>>> col = Column(FieldSchema(kind="dense", dtype=torch.int64, inner_shape=()), torch.arange(3))
>>> move_columns({"x": col}, torch.device("cpu"), "always")["x"].values.tolist()
[0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from dataplane.codec.wire import Column
from dataplane.worker.pinned import process_pool

__all__ = ["PinnedMode", "move_columns"]

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
