"""Host-device copies through a bounded pool of pinned buffers, overlapped on a side CUDA stream.

A copy between pageable host memory and a GPU runs at a fraction of the link (the driver stages it
through a pinned bounce buffer of its own, one piece at a time). :class:`PinnedPool` stages it
through pinned chunks it owns instead, and pipelines them: while chunk ``k`` is copied by the DMA
engine (a side stream), the CPU fills chunk ``k + 1``.

* **Host to device** (:meth:`PinnedPool.fill`, :meth:`PinnedPool.to_device`): the destination is
  allocated on the caller's current stream, the side stream waits for that stream, each chunk is
  written into a free pinned buffer -- by a store read landing there (``fill``: the fetch's one host
  copy, :mod:`dataplane.adapters.read_into`) or a memcpy from host tensors (``to_device``) -- and
  copied on the side stream; the caller's stream then waits on the side stream (no device
  synchronize), so kernels the caller queues next see the data.
* **Device to host** (:meth:`PinnedPool.to_host`): the side stream waits for the caller's stream (the
  producer's kernels), copies chunks into pinned buffers, and the CPU moves each finished chunk to
  the result while the next one is in flight: memory the caller's ``empty`` makes (a client's, which
  its put sends or keeps without another copy) or pageable memory. Returns when it is complete.
* **Bounded memory**: at most ``cap_bytes`` of pinned memory, as ``cap_bytes // chunk_bytes`` buffers
  allocated on first use and reused by every later copy; a tensor larger than the pool streams
  through it. :meth:`close` frees them (the worker mixin calls it in ``close_data_plane``).

On a machine without CUDA the same code runs with plain host buffers and synchronous copies (the
chunking and the accounting are what the CPU tests check).

>>> import torch
>>> pool = PinnedPool(cap_bytes=64, chunk_bytes=16)
>>> x = torch.arange(30, dtype=torch.int32)            # 120 bytes: 8 chunks through 4 buffers
>>> torch.equal(pool.to_device([x], torch.device("cpu"))[0], x)
True
>>> pool.stats()["allocated_bytes"], pool.stats()["buffers_in_use"]  # no DMA in flight on a CPU: one buffer
(16, 0)
>>> pool.close()
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dataplane.checks import check_int
from dataplane.errors import DataPlaneTimeout, InvalidArgument

__all__ = ["DEFAULT_CAP_BYTES", "DEFAULT_CHUNK_BYTES", "PinnedPool", "process_pool"]

DEFAULT_CAP_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 32 << 20
_WAIT_S = 60.0  # the longest wait for a buffer (a copy of one chunk takes about a millisecond)
_POLL_S = 20e-6


class _Buffer:
    __slots__ = ("data", "event")

    def __init__(self, data: Tensor) -> None:
        self.data = data
        self.event: Any = None  # the CUDA event of the last copy that used it

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once the buffer's last copy is done (polled: a stuck copy raises after ``timeout_s``,
        default ``_WAIT_S``, never hangs)."""
        if self.event is None:
            return
        if not self.event.query():
            timeout_s = _WAIT_S if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout_s
            while not self.event.query():
                if time.monotonic() > deadline:
                    raise DataPlaneTimeout(
                        f"a pinned buffer's copy did not end within {timeout_s:.0f} s; the GPU is stuck"
                    )
                time.sleep(_POLL_S)
        self.event = None


def _bytes(t: Tensor) -> Tensor:
    """A flat uint8 view of a contiguous tensor's storage."""
    return t.reshape(-1).view(torch.uint8)


class PinnedPool:
    """A bounded pool of pinned host buffers and a side stream per device; see the module docstring.

    Thread-safe: calls from several threads share the buffers (each takes what is free and waits
    for a buffer otherwise). Every copy returns its buffers, also when it raises.

    Args:
        cap_bytes: most pinned memory the pool holds (rounded down to whole chunks; at least one).
        chunk_bytes: bytes per buffer (and per pipelined copy).
    """

    def __init__(self, cap_bytes: int = DEFAULT_CAP_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        check_int("chunk_bytes", chunk_bytes, low=1)
        check_int("cap_bytes", cap_bytes, low=chunk_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self.max_buffers = int(cap_bytes) // self.chunk_bytes
        self._free: collections.deque[_Buffer] = collections.deque()  # oldest first
        self._count = 0
        self._in_use = 0
        self._peak = 0
        self._copied = 0
        self._cv = threading.Condition()
        self._streams: dict[int, Any] = {}
        self._pinned = torch.cuda.is_available()

    # -- buffers ----------------------------------------------------------------------------------
    def _take(self) -> _Buffer:
        """A buffer whose last copy is done: an idle free one, else a new one while under the cap,
        else the oldest free one (waiting for its copy), else wait for one to come back."""
        with self._cv:
            while not self._free and self._count >= self.max_buffers:
                if not self._cv.wait(timeout=_WAIT_S):
                    raise DataPlaneTimeout(f"no pinned buffer came free within {_WAIT_S:.0f} s; a copy is stuck")
            idle = self._free and (self._free[0].event is None or self._free[0].event.query())
            if idle or self._count >= self.max_buffers:
                buf = self._free.popleft()
            else:
                buf = _Buffer(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pinned))
                self._count += 1
            self._in_use += 1
            self._peak = max(self._peak, self._in_use)
        try:
            buf.wait()
        except BaseException:  # back to the pool (its event kept: the next taker waits for it again)
            with self._cv:
                self._free.appendleft(buf)
                self._in_use -= 1
                self._cv.notify()
            raise
        return buf

    def _give(self, buf: _Buffer, copied: int = 0) -> None:
        with self._cv:
            self._free.append(buf)
            self._in_use -= 1
            self._copied += copied
            self._cv.notify()

    def _side_stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        return stream

    # -- copies ---------------------------------------------------------------------------------
    def to_device(self, tensors: Sequence[Tensor], device: torch.device | str) -> list[Tensor]:
        """Copies of host ``tensors`` on ``device`` (same shapes, dtypes, values), staged through the
        pool; on CUDA the caller's current stream is made to wait for them (no device synchronize)."""
        device = torch.device(device)
        if device.type == "cuda" and not self._pinned:
            raise InvalidArgument("a copy to a CUDA device on a machine where torch sees no CUDA")
        srcs = [_bytes(t if t.is_contiguous() else t.contiguous()) for t in tensors]
        outs = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors]

        def source(i: int, o: int, window: Tensor) -> None:
            window.copy_(srcs[i][o : o + window.numel()])

        self.fill(outs, source)
        return outs

    def fill(self, dsts: Sequence[Tensor], source: Callable[[int, int, Tensor], None]) -> None:
        """Fill contiguous ``dsts`` (CUDA tensors; host tensors on the CPU path) through the pool:
        ``source(i, offset, window)`` writes bytes ``offset .. offset + window.numel()`` of what
        ``dsts[i]`` is to hold into ``window`` (a pinned uint8 buffer), whose copy to ``dsts[i]`` then
        runs on a side stream while ``source`` fills the next window. On CUDA the caller's current
        stream is made to wait for the copies (no device synchronize); every buffer comes back, also
        when ``source`` raises.

        A store read landing here (:mod:`dataplane.adapters.read_into`) is the one host copy of a
        fetch; :meth:`to_device` is this with ``source`` copying from host tensors.
        """
        if not all(d.is_contiguous() for d in dsts):
            raise InvalidArgument("PinnedPool.fill writes contiguous tensors only")
        outs = [_bytes(d) for d in dsts]
        devices = {d.device for d in dsts if d.numel()}
        if len(devices) > 1:
            raise InvalidArgument(
                f"PinnedPool.fill fills tensors of one device at a time, got {sorted(map(str, devices))}"
            )
        device = devices.pop() if devices else torch.device("cpu")
        cuda = device.type == "cuda"
        if cuda and not self._pinned:
            raise InvalidArgument("a copy to a CUDA device on a machine where torch sees no CUDA")
        current: Any = torch.cuda.current_stream(device) if cuda else None
        side = self._side_stream(device) if cuda else None
        if side is not None:
            side.wait_stream(current)
        held: list[_Buffer] = []
        try:
            for i, d in enumerate(outs):
                for o in range(0, d.numel(), self.chunk_bytes):
                    n = min(self.chunk_bytes, d.numel() - o)
                    buf = self._take()
                    held.append(buf)
                    source(i, o, buf.data[:n])
                    if side is not None:
                        with torch.cuda.stream(side):
                            d[o : o + n].copy_(buf.data[:n], non_blocking=True)
                            buf.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                            buf.event.record(side)
                    else:
                        d[o : o + n].copy_(buf.data[:n])
                    held.remove(buf)
                    self._give(buf, n)  # reusable once its event has fired (_take waits on it)
        finally:
            for buf in held:
                self._give(buf)
            if side is not None:
                current.wait_stream(side)

    def to_host(
        self, tensors: Sequence[Tensor], empty: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None
    ) -> list[Tensor]:
        """Copies of ``tensors`` in host memory, staged through the pool; returns when they are
        complete. CUDA sources are read after the caller's current stream's queued work. ``empty``
        makes each result (``shape, dtype -> tensor``; a client's ``empty``, whose memory its put
        sends without a copy); by default pageable ``torch.empty``."""
        outs: list[Tensor] = []
        for t in tensors:
            src = t if t.is_contiguous() else t.contiguous()
            dst = None if empty is None else empty(tuple(src.shape), src.dtype)
            if (
                dst is None
                or dst.shape != src.shape
                or dst.dtype != src.dtype
                or not dst.is_contiguous()
                or not dst.is_cpu
            ):
                dst = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            outs.append(dst)
            if not src.numel():
                continue
            side = None
            if src.device.type == "cuda":
                side = self._side_stream(src.device)
                side.wait_stream(torch.cuda.current_stream(src.device))
            self._drain(_bytes(src), _bytes(dst), side)
        return outs

    def _drain(self, s: Tensor, d: Tensor, side: Any) -> None:
        """Device bytes ``s`` to host bytes ``d``: DMA chunks into buffers on ``side``, the CPU moving
        each finished one out while later ones are in flight (at most half the pool queued)."""
        window = max(1, self.max_buffers // 2)
        inflight: collections.deque[tuple[_Buffer, int, int]] = collections.deque()
        try:
            for o in range(0, s.numel(), self.chunk_bytes):
                if len(inflight) >= window:
                    self._finish(inflight.popleft(), d)
                n = min(self.chunk_bytes, s.numel() - o)
                buf = self._take()
                inflight.append((buf, o, n))
                if side is None:  # a host source (the CPU path): a plain copy
                    buf.data[:n].copy_(s[o : o + n])
                    continue
                with torch.cuda.stream(side):
                    buf.data[:n].copy_(s[o : o + n], non_blocking=True)
                    buf.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    buf.event.record(side)
            while inflight:
                self._finish(inflight.popleft(), d)
        finally:
            deadline = time.monotonic() + _WAIT_S  # one bound for all of them, not one per buffer
            for buf, _, _ in inflight:
                with contextlib.suppress(DataPlaneTimeout):  # else its event stays: _take waits for it again
                    buf.wait(max(0.0, deadline - time.monotonic()))
                self._give(buf)

    def _finish(self, item: tuple[_Buffer, int, int], d: Tensor) -> None:
        buf, o, n = item
        copied = 0
        try:
            buf.wait()
            d[o : o + n].copy_(buf.data[:n])
            copied = n
        finally:
            self._give(buf, copied)

    # -- lifecycle --------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``cap_bytes``, ``chunk_bytes``, ``allocated_bytes`` (pinned memory held now),
        ``buffers_in_use`` (checked out now), ``peak_bytes_in_use``, ``copied_bytes`` (so far)."""
        with self._cv:
            return {
                "cap_bytes": self.max_buffers * self.chunk_bytes,
                "chunk_bytes": self.chunk_bytes,
                "allocated_bytes": self._count * self.chunk_bytes,
                "buffers_in_use": self._in_use,
                "peak_bytes_in_use": self._peak * self.chunk_bytes,
                "copied_bytes": self._copied,
            }

    def close(self) -> None:
        """Wait for copies in flight, free every buffer (and torch's cache of freed pinned memory)."""
        with self._cv:  # taken out under the lock, waited for outside it (never blocking _take/_give)
            idle = list(self._free)
            self._count -= len(idle)
            self._free.clear()
        deadline = time.monotonic() + _WAIT_S
        for buf in idle:
            buf.wait(max(0.0, deadline - time.monotonic()))
        if self._pinned:
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()


_PROCESS_POOL: PinnedPool | None = None
_PROCESS_LOCK = threading.Lock()


def process_pool() -> PinnedPool:
    """The process's pool, which every worker of the process shares (created on first use).

    Its cap is ``DATAPLANE_PINNED_BYTES`` (a size: ``256MiB`` by default, ``1GiB``, ...) and its chunk
    ``DATAPLANE_PINNED_CHUNK_BYTES`` (``32MiB``), read when it is created; it holds no pinned memory
    until a copy needs it, and :meth:`PinnedPool.close` (``close_data_plane``) gives that back.
    """
    global _PROCESS_POOL
    with _PROCESS_LOCK:
        if _PROCESS_POOL is None:
            import os

            from dataplane.checks import check_bytes

            cap = check_bytes("DATAPLANE_PINNED_BYTES", os.environ.get("DATAPLANE_PINNED_BYTES", "256MiB"), low=1)
            chunk = check_bytes(
                "DATAPLANE_PINNED_CHUNK_BYTES", os.environ.get("DATAPLANE_PINNED_CHUNK_BYTES", "32MiB"), low=1
            )
            _PROCESS_POOL = PinnedPool(cap_bytes=cap, chunk_bytes=min(chunk, cap))
        return _PROCESS_POOL
