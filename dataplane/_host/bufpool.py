"""A pool of large, already-faulted host buffers handed out as tensors.

Allocating a fresh 128 MB tensor costs more in page faults than copying into it. The pool keeps released slabs and hands them out again. A slab
goes back to the pool only when the tensor it was lent as, and every view of it, is gone, so a
caller owns what it gets exactly as if it were ``torch.empty``.

Adapters that must register memory with a transport (Mooncake, RDMA) pass ``on_new``/``on_drop``
so each slab is registered once, when created, and unregistered when the pool drops it. Adapters
whose transport reaches only memory it hands out (Mooncake's shared-memory client) also pass
``alloc``: then every buffer, pooled or not, comes from it, and ``on_drop`` gives it back.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Mapping

import numpy as np
import torch

__all__ = ["SHARED_MIN", "BufferPool", "default_pool"]

_MIN_POOLED = 1 << 20
SHARED_MIN = 1 << 20  # entries this large share a carved buffer (see BufferPool.carve)
_ALIGN = 64  # byte alignment of each slice of it


def _size_class(nbytes: int) -> int:
    """Round up to 1/8 steps of a power of two (at most 12.5% slack)."""
    top = 1 << (max(nbytes, 1) - 1).bit_length()
    step = max(top // 16, 4096)
    return -(-nbytes // step) * step


class BufferPool:
    """Hands out uint8 tensors backed by reusable slabs.

    Args:
        max_bytes: most bytes of slabs kept (lent plus idle); beyond it, buffers are plain allocations.
        min_bytes: requests smaller than this bypass the pool (malloc is fast for them).
        on_new: called with each new slab (a uint8 numpy array) before first use, e.g. to register it.
        on_drop: called with a slab the pool lets go of.
        alloc: makes the memory of every buffer (``nbytes`` -> uint8 numpy array) instead of
            ``np.empty``; buffers beyond ``max_bytes`` or under ``min_bytes`` come from it too and
            go to ``on_drop`` when their tensor dies.
    """

    def __init__(
        self,
        max_bytes: int,
        *,
        min_bytes: int = _MIN_POOLED,
        on_new: Callable[[np.ndarray], None] | None = None,
        on_drop: Callable[[np.ndarray], None] | None = None,
        alloc: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._on_new = on_new
        self._on_drop = on_drop
        self._alloc = alloc
        self._lock = threading.RLock()
        self._idle: dict[int, list[np.ndarray]] = {}
        self._total = 0
        self._closed = False
        self.hits = 0
        self.misses = 0

    @property
    def pooled_bytes(self) -> int:
        return self._total

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (contents undefined), reusing an idle slab when one fits."""
        if nbytes < self.min_bytes or self._closed:
            return self._unpooled(nbytes)
        size = _size_class(nbytes)
        slab = self._take(size)
        if slab is None:
            return self._unpooled(nbytes)
        lent = slab[:nbytes]
        weakref.finalize(lent, self._give_back, size, slab)
        return torch.from_numpy(lent)

    def _unpooled(self, nbytes: int) -> torch.Tensor:
        if self._alloc is None or self._closed:
            return torch.empty(nbytes, dtype=torch.uint8)
        raw = self._alloc(max(nbytes, 1))
        lent = raw[:nbytes]
        if self._on_drop is not None:
            weakref.finalize(lent, self._on_drop, raw)
        return torch.from_numpy(lent)

    def carve(self, nbytes: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """Slices of one buffer (uint8, 64-byte aligned) for the entries of ``nbytes`` of
        :data:`SHARED_MIN` bytes or more: one allocation and one run of huge pages for a batch's large
        fields instead of one each, returned to the pool when the last slice is gone. Smaller entries
        get no slice, so a kept small field (a ``[B]`` reward) never pins the batch."""
        slab, at = self.slab(nbytes)
        return {} if slab is None else {name: slab[o : o + nbytes[name]] for name, o in at.items()}

    def slab(self, nbytes: Mapping[str, int], *, align: int = _ALIGN) -> tuple[torch.Tensor | None, dict[str, int]]:
        """The buffer :meth:`carve` slices and the byte offset of each entry in it (None and ``{}``
        when no entry is large enough), for callers that need only addresses yet. Each entry starts at
        a multiple of ``align`` bytes."""
        at: dict[str, int] = {}
        total = 0
        for name, n in nbytes.items():
            if n >= SHARED_MIN:
                at[name] = total
                total += -(-n // align) * align
        return (self.empty(total) if at else None), at

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` backed by the pool."""
        return self.empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)

    def _take(self, size: int) -> np.ndarray | None:
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                self.hits += 1
                return idle.pop()
            self.misses += 1
            if self._total + size > self.max_bytes:
                self._shrink(self.max_bytes - size)
            if self._total + size > self.max_bytes:
                return None
            self._total += size
        try:
            slab = np.empty(size, dtype=np.uint8) if self._alloc is None else self._alloc(size)
        except BaseException:
            with self._lock:
                self._total -= size
            raise
        if self._on_new is not None:
            try:
                self._on_new(slab)
            except BaseException:
                with self._lock:
                    self._total -= size
                raise
        return slab

    def _give_back(self, size: int, slab: np.ndarray) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(size, []).append(slab)
                return
            self._total -= size
        if self._on_drop is not None:
            self._on_drop(slab)

    def _shrink(self, target: int) -> None:
        """Drop idle slabs, largest first, until at most ``target`` bytes are pooled."""
        for size in sorted(self._idle, reverse=True):
            idle = self._idle[size]
            while idle and self._total > target:
                slab = idle.pop()
                self._total -= size
                if self._on_drop is not None:
                    self._on_drop(slab)

    def trim(self) -> None:
        """Release every idle slab."""
        with self._lock:
            self._shrink(0)

    def close(self) -> None:
        """Release idle slabs now and lent ones when their tensors die."""
        with self._lock:
            self._closed = True
            self._shrink(0)


_DEFAULT: BufferPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> BufferPool:
    """The process-wide pool used for get results (4 GiB of idle-or-lent slabs at most)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = BufferPool(4 << 30)
        return _DEFAULT
