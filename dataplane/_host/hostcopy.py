"""Host-memory byte copies that leave no busy threads behind.

``torch.Tensor.copy_`` of a large CPU tensor runs on torch's OpenMP pool, whose threads keep
spinning for a while after the copy. When a transfer follows at once (a put staging its tensors into
registered memory, then sending them), those spinning threads take the cores the transport's own
threads need (a staged Mooncake put then runs well below a raw put that copies with numpy). A copy
here runs on numpy, which holds no GIL while it moves bytes, split over a few threads of our own
that sleep when idle.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dataplane._host.threads import LazyPool, usable_cpus

__all__ = ["copy_bytes", "copy_spans", "gather_bytes", "merge_spans"]

_SPLIT_MIN = 4 << 20  # copies from this size on are split; each piece is at least this large
_MAX_THREADS = 4  # memory-bound: a few threads reach the host's copy bandwidth
_PAGE = 4096

_HELPERS = LazyPool(_MAX_THREADS - 1, "dataplane-copy")

# A gather of spans averaging fewer elements than this goes by an element index (np.take) instead
# of one slice per span: a slice costs ~0.3 us whatever its size, an indexed element 1-3 ns.
_INDEX_BELOW = 100
_INDEX_BLOCK = 1 << 18  # elements per index block (2 MB of int64 indices, kept per thread)
# Short spans go by element index only when there are this many per source: each source costs a few
# numpy calls (~10 us), which thousands of single-row sources (rows put one at a time) would not repay.
_SPANS_PER_SOURCE = 16
_WORDS = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


def _threads() -> int:
    return max(1, min(_MAX_THREADS, usable_cpus()))


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of contiguous CPU tensor ``src`` into contiguous CPU tensor ``dst`` (same byte
    size, any dtypes)."""
    d, s = _as_bytes(dst), _as_bytes(src)
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy_bytes: {s.nbytes} bytes into {d.nbytes}")
    n = d.nbytes
    parts = min(_threads(), n // _SPLIT_MIN)
    if parts <= 1:
        np.copyto(d, s)
        return
    step = -(-n // parts // _PAGE) * _PAGE
    pending = [_HELPERS.submit(np.copyto, d[at : at + step], s[at : at + step]) for at in range(step, n, step)]
    try:
        np.copyto(d[:step], s[:step])
    finally:  # no timeout: a memcpy always ends, and returning early would free bytes still being written
        for f in pending:
            f.result()


def merge_spans(
    which: np.ndarray | None, lands: np.ndarray, starts: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
    """The spans of :func:`copy_spans` without the empty ones, and with neighbours contiguous in both
    the destination and one source merged: ``(which, lands, starts, sizes)``.

    >>> w, l, s, n = merge_spans(None, np.array([0, 4, 4]), np.array([8, 99, 12]), np.array([4, 0, 4]))
    >>> l.tolist(), s.tolist(), n.tolist()
    ([0], [8], [8])
    """
    keep = sizes > 0
    if not keep.all():
        lands, starts, sizes = lands[keep], starts[keep], sizes[keep]
        which = None if which is None else which[keep]
    if len(sizes) > 1:
        joined = (lands[1:] == lands[:-1] + sizes[:-1]) & (starts[1:] == starts[:-1] + sizes[:-1])
        if which is not None:
            joined &= which[1:] == which[:-1]
        if joined.any():
            head = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(~joined) + 1))
            lands, starts, sizes = lands[head], starts[head], np.add.reduceat(sizes, head)
            which = None if which is None else which[head]
    return which, lands, starts, sizes


def copy_spans(
    dst: torch.Tensor,
    srcs: Sequence[torch.Tensor],
    which: np.ndarray | None,
    lands: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
) -> None:
    """Copy ``srcs[which[k]][starts[k] : starts[k] + sizes[k]]`` to ``dst[lands[k] : lands[k] + sizes[k]]``
    for every k (uint8 tensors; ``which`` None: every span is in ``srcs[0]``). The spans land apart
    from each other, in any order; empty ones are skipped, and neighbours contiguous in both ``dst``
    and one source are merged.

    Rows written back by several data-parallel ranks alternate between sources row by row, so a
    get's spans are many and short: a slice copies one at ~0.3 us whatever its size, so short spans
    instead go by an element index, one ``np.take`` per source (and block of ``_INDEX_BLOCK`` words),
    scattered with one indexed assignment where they do not land back to back. Long spans, or short
    ones from nearly as many sources, go as slices: one ``np.concatenate`` per stretch landing back
    to back."""
    which, lands, starts, sizes = merge_spans(which, lands, starts, sizes)
    n = len(sizes)
    if n == 1:
        a, s, m = int(lands[0]), int(starts[0]), int(sizes[0])
        dst[a : a + m].copy_(srcs[0 if which is None else int(which[0])][s : s + m])
        return
    if not n:
        return
    low = int(np.bitwise_or.reduce(lands) | np.bitwise_or.reduce(starts) | np.bitwise_or.reduce(sizes))
    word = next(w for w in _WORDS if low % w == 0)  # widest word every span is made of
    sources = 1 if which is None else len(srcs)
    if int(sizes.sum()) // word < _INDEX_BELOW * n and n >= _SPANS_PER_SOURCE * sources:
        d = dst.numpy()
        d = d[: d.size // word * word].view(_WORDS[word])
        if which is None:
            _take(d, _words(srcs[0], word), lands // word, starts // word, sizes // word)
            return
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(sources + 1)).tolist()
        for k in range(sources):
            at = order[bounds[k] : bounds[k + 1]]
            if len(at):
                _take(d, _words(srcs[k], word), lands[at] // word, starts[at] // word, sizes[at] // word)
        return
    if (lands[1:] < lands[:-1]).any():
        order = np.argsort(lands, kind="stable")
        lands, starts, sizes = lands[order], starts[order], sizes[order]
        which = None if which is None else which[order]
    d, s_np = dst.numpy(), [s.numpy() for s in srcs]
    cut = (np.flatnonzero(lands[1:] != lands[:-1] + sizes[:-1]) + 1).tolist()
    ws = [0] * n if which is None else which.tolist()
    ss, ms = starts.tolist(), sizes.tolist()
    for lo, hi in zip([0, *cut], [*cut, n], strict=True):
        a = int(lands[lo])
        pieces = [s_np[w][s : s + m] for w, s, m in zip(ws[lo:hi], ss[lo:hi], ms[lo:hi], strict=True)]
        np.concatenate(pieces, out=d[a : a + sum(ms[lo:hi])])


def gather_bytes(dst: torch.Tensor, src: torch.Tensor, starts: np.ndarray, sizes: np.ndarray) -> None:
    """Copy ``src[starts[k] : starts[k] + sizes[k]]`` for every k, back to back, into ``dst`` (uint8
    tensors; ``dst`` holds exactly ``sizes.sum()`` bytes): :func:`copy_spans` from one source."""
    copy_spans(dst, [src], None, np.cumsum(sizes) - sizes, starts, sizes)


def _words(t: torch.Tensor, word: int) -> np.ndarray:
    b = t.numpy()
    return b[: b.size // word * word].view(_WORDS[word])


class _Scratch(threading.local):
    """Per-thread buffers for element indices, kept between gathers: fresh memory costs a page fault
    per 4 KiB on first touch, and temporaries of a few MB come fresh from the OS again and again,
    which made a gather of short rows several times slower than its copies.
    A thread that gathered keeps at most two index blocks and one block of values per word size
    (~8 MB)."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[str, np.dtype[Any]], np.ndarray] = {}

    def get(self, name: str, n: int, dtype: Any) -> np.ndarray:
        if n > _INDEX_BLOCK:  # one span longer than a block: not worth keeping
            return np.empty(n, dtype=dtype)
        key = (name, np.dtype(dtype))
        buf = self.bufs.get(key)
        if buf is None or len(buf) < n:
            buf = self.bufs[key] = np.empty(_INDEX_BLOCK, dtype=dtype)
        return buf[:n]


_SCRATCH = _Scratch()


def _ragged_range(out: np.ndarray, heads: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``out`` (``sizes.sum()`` entries) filled with ``starts[k], starts[k] + 1, ...`` for ``sizes[k]``
    entries each, span k from ``heads[k]`` on: one cumulative sum of steps, no temporaries."""
    out.fill(1)
    steps = np.empty(len(starts), dtype=np.int64)
    steps[0] = starts[0]
    np.subtract(starts[1:], starts[:-1] + sizes[:-1] - 1, out=steps[1:])
    out[heads] = steps
    np.cumsum(out, out=out)
    return out


def _take(d: np.ndarray, s: np.ndarray, lands: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> None:
    """Copy spans (none empty) by element index (all in words), a block of at most ``_INDEX_BLOCK``
    words (or one span) at a time: into ``d`` directly where a block's spans land back to back, else
    scattered."""
    ends = np.cumsum(sizes)
    rel = ends - sizes  # where each span starts among the ones copied
    i, n = 0, len(sizes)
    while i < n:
        j = max(i + 1, int(np.searchsorted(ends, rel[i] + _INDEX_BLOCK, side="right")))
        base, m = int(rel[i]), int(ends[j - 1] - rel[i])
        heads = rel[i:j] - base
        idx = _ragged_range(_SCRATCH.get("idx", m, np.int64), heads, starts[i:j], sizes[i:j])
        to = lands[i:j] - heads
        if (to == to[0]).all():  # lands back to back: take straight into place
            np.take(s, idx, out=d[int(to[0]) : int(to[0]) + m])
        else:
            at = _ragged_range(_SCRATCH.get("at", m, np.int64), heads, lands[i:j], sizes[i:j])
            d[at] = np.take(s, idx, out=_SCRATCH.get("val", m, s.dtype))
        i = j
