"""Optional store surfaces that let a caller's own buffers be the ones a transfer lands in or leaves from.

A plain get copies a shard's bytes into memory the store allocates, and the caller copies them again
into where it needs them (the pinned chunks a GPU copy streams through); a plain put copies the
caller's tensors into the store's memory. A store that also implements one of these small protocols
lets the worker's GPU path (:mod:`dataplane.worker.pipeline`) skip that second copy. Callers check
them with ``isinstance`` (they are ``runtime_checkable``), never the adapter's type.

* :class:`ReadsInto` -- ``begin_read_into`` plans a get without copying anything: a
  :class:`WindowedRead` whose ``columns`` give each field's layout (schema, shape, offsets; the
  values on the ``meta`` device, which holds no bytes) and whose ``read_into(field, start, dst)``
  copies any byte window of a field's values (rows back to back, in key order) into ``dst``. The
  worker fills its pinned chunks with it, one window at a time, each chunk's copy to the GPU
  overlapping the next window's read: the host bytes are copied once. ``memory://`` implements it.
* :attr:`WindowedRead.device_direct` -- the seam for a backend that moves data straight into GPU
  memory (Mooncake's CUDA build with GPU-direct transfers): when true, ``read_into`` takes
  destinations in device memory, and the worker hands it the GPU tensors themselves, with no pinned
  staging. No shipped backend sets it.
* :class:`AdoptsPuts` -- ``adopting(tensors)`` is a scope in which the calling thread's puts keep
  those host tensors as they are instead of copying them: the caller hands them over and never
  touches them again. The worker's write-back uses it for the host copies it made of GPU results.

``mooncake://`` implements neither reading protocol: over shared memory its reads land whole objects
in memory the store server reaches only (see ``docs/workers.md``); its ``client.empty()`` memory is
what a write-back's host copies land in, so that its put sends them without staging them.

>>> import dataplane, torch
>>> with dataplane.connect("memory://") as c:
...     meta = c.kv_batch_put(["a", "b"], {"x": [torch.arange(3), torch.arange(2)]}, partition_id="p")
...     read = c.store.begin_read_into("p", ["a", "b"], ["x"], meta=meta, timeout_s=5.0)
...     window = torch.zeros(16, dtype=torch.uint8)
...     read.read_into("x", 8, window)  # bytes 8..24 of x's values: elements 1 and 2 of row a
...     read.columns["x"].values.shape, window.view(torch.int64).tolist()
(torch.Size([5]), [1, 2])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

from dataplane.codec.wire import Column
from dataplane.meta import KVBatchMeta

__all__ = ["AdoptsPuts", "ReadsInto", "WindowedRead"]


class WindowedRead(Protocol):
    """A get that is planned and holds what it reads, its bytes copied out on demand."""

    @property
    def columns(self) -> Mapping[str, Column]:
        """Field -> its column with ``values`` on the ``meta`` device (shape and dtype, no bytes) and
        its ``offsets`` (int64, on the CPU) for jagged and object fields."""
        ...

    @property
    def device_direct(self) -> bool:
        """Whether :meth:`read_into` also takes destinations in GPU memory (GPU-direct transfer)."""
        ...

    def read_into(self, field: str, start: int, dst: torch.Tensor) -> None:
        """Copy bytes ``start .. start + dst.numel()`` of ``field``'s values into ``dst`` (contiguous
        uint8). Raises ``InvalidArgument`` for a window outside the field or a ``dst`` it cannot
        write. A ``device_direct`` read writing device memory has finished writing when this returns
        (the caller's stream was synchronised before the call)."""
        ...


@runtime_checkable
class ReadsInto(Protocol):
    """A store whose gets can land in the caller's buffers (see the module docstring)."""

    def begin_read_into(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> WindowedRead:
        """Plan the get of ``fields`` of ``keys`` (arguments and errors as ``KVStore.get``: it raises
        ``KeyNotFound`` here when a row or field is absent) and copy none of its bytes yet."""
        ...


@runtime_checkable
class AdoptsPuts(Protocol):
    """A store that can keep a put's host tensors instead of copying them (see the module docstring)."""

    def adopting(self, tensors: Sequence[torch.Tensor]) -> AbstractContextManager[None]:
        """A scope in which this thread's puts keep each of ``tensors`` (whole, contiguous, on the
        CPU) that a column's values are, as they are; the caller must not write them afterwards."""
        ...
