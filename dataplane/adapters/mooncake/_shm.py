"""Memory a Mooncake real client can reach: shared-memory arenas carved first-fit.

A client attached to a real client on its host (``MooncakeDistributedStore.setup_dummy``) moves data
through shared memory: the real client copies between its segment and the caller's buffer, which
must lie in a region made by ``alloc_from_mem_pool`` (a memfd) and registered with
``register_buffer`` (which passes the fd to the real client). Any other pointer gets ``-600``.

Mooncake never unmaps such a region before the process exits, so regions are made in large chunks,
carved here, and kept for the life of the process: a region whose every piece came back is reused
by the next client of this process (registered again with it). A region whose client could not
unregister it (its real client died) is never reused: it is still marked registered in Mooncake.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dataplane.errors import CapacityExceeded

__all__ = ["CHUNK", "Arena", "ShmArenas"]

CHUNK = 256 << 20  # bytes per region (pages are touched only when used)
_ALIGN = 4096


@dataclass(eq=False)
class Arena:
    """One registered memfd region: ``view`` is all of it; ``free`` holds sorted ``[offset, size]`` holes."""

    base: int
    size: int
    view: np.ndarray
    free: list[list[int]]
    taken: dict[int, int] = field(default_factory=dict)  # offset -> size of each live piece
    owner: object | None = None  # the ShmArenas that may carve it; None once that client closed
    poisoned: bool = False  # unregistering failed: never hand it to another client

    def carve(self, nbytes: int) -> int | None:
        for hole in self.free:
            if hole[1] >= nbytes:
                off = hole[0]
                hole[0] += nbytes
                hole[1] -= nbytes
                if not hole[1]:
                    self.free.remove(hole)
                self.taken[off] = nbytes
                return off
        return None

    def give_back(self, off: int) -> None:
        n = self.taken.pop(off)
        holes = self.free
        i = 0
        while i < len(holes) and holes[i][0] < off:
            i += 1
        holes.insert(i, [off, n])
        if i + 1 < len(holes) and off + n == holes[i + 1][0]:  # merge with the next hole
            holes[i][1] += holes.pop(i + 1)[1]
        if i and holes[i - 1][0] + holes[i - 1][1] == off:  # and with the previous one
            holes[i - 1][1] += holes.pop(i)[1]


_LOCK = threading.Lock()
_IDLE: list[Arena] = []  # regions of this process no client uses, every piece returned
_LIVE: list[Arena] = []  # regions some open client carves
_ORPHANS: list[Arena] = []  # regions of closed clients with pieces still lent out
# Pieces given back but not yet put back in their region. ``free`` runs from tensor finalizers, i.e.
# whenever the garbage collector runs, possibly in a thread that holds _LOCK: it never waits for it.
_RETURNED: deque[int] = deque()


def _take_back() -> None:
    """Put the returned pieces back (caller holds _LOCK)."""
    while _RETURNED:
        ptr = _RETURNED.popleft()
        for arena in (*_LIVE, *_ORPHANS):
            if arena.base <= ptr < arena.base + arena.size:
                arena.give_back(ptr - arena.base)
                if arena.owner is None and not arena.taken:
                    _ORPHANS.remove(arena)
                    if not arena.poisoned:
                        _IDLE.append(arena)
                break


class ShmArenas:
    """The regions one shared-memory client carves its buffers from.

    Args:
        make: ``nbytes -> address`` of a new memfd region (``alloc_from_mem_pool``).
        register: ``(address, nbytes)`` -> None (``register_buffer``); raises a typed error on failure.
        unregister: ``address -> rc`` (``unregister_buffer``).
    """

    def __init__(
        self,
        make: Callable[[int], int],
        register: Callable[[int, int], None],
        unregister: Callable[[int], int],
    ) -> None:
        self._make, self._register, self._unregister = make, register, unregister
        self._mine: list[Arena] = []

    def spans(self) -> list[tuple[int, int]]:
        with _LOCK:
            _take_back()
            return [(a.base, a.size) for a in self._mine]

    def holds(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies in one region of this client (the real client reaches it)."""
        with _LOCK:
            return any(a.base <= ptr and ptr + nbytes <= a.base + a.size for a in self._mine)

    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` the real client can read and write (contents undefined)."""
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        with _LOCK:
            _take_back()
            for arena in self._mine:
                off = arena.carve(need)
                if off is not None:
                    return arena.view[off : off + nbytes]
            arena = self._adopt(need)
            off = arena.carve(need)
            assert off is not None
            return arena.view[off : off + nbytes]

    def _adopt(self, need: int) -> Arena:
        """An idle region of at least ``need`` bytes, or a new one, registered with this client."""
        fits = [a for a in _IDLE if a.size >= need]
        arena = min(fits, key=lambda a: a.size) if fits else None
        if arena is None:
            size = max(CHUNK, need)
            base = int(self._make(size))
            if not base:
                raise CapacityExceeded(
                    f"could not map {size} bytes of shared memory for Mooncake (memfd); free host memory, hold "
                    "fewer fetched batches at once, or connect with shm=false"
                )
            view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))
            arena = Arena(base, size, view, [[0, size]])
        try:
            self._register(arena.base, arena.size)
        except BaseException:
            if arena not in _IDLE:  # a new region: keep it for the next try
                _IDLE.append(arena)
            raise
        if arena in _IDLE:
            _IDLE.remove(arena)
        arena.owner = self
        self._mine.append(arena)
        _LIVE.append(arena)
        return arena

    @staticmethod
    def free(arr: np.ndarray) -> None:
        """Return a piece from :meth:`alloc` (``BufferPool`` ``on_drop``); never blocks."""
        _RETURNED.append(int(arr.ctypes.data))
        if _LOCK.acquire(blocking=False):
            try:
                _take_back()
            finally:
                _LOCK.release()

    def release(self) -> None:
        """Unregister every region (before the client closes); they are reused once all pieces return."""
        with _LOCK:
            _take_back()
            mine, self._mine = self._mine, []
            for arena in mine:
                _LIVE.remove(arena)
                arena.owner = None
                try:
                    arena.poisoned = self._unregister(arena.base) != 0
                except Exception:
                    arena.poisoned = True
                if arena.taken:
                    _ORPHANS.append(arena)
                elif not arena.poisoned:
                    _IDLE.append(arena)
