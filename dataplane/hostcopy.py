"""Host-memory byte copies that leave no busy threads behind.

``torch.Tensor.copy_`` of a large CPU tensor runs on torch's OpenMP pool, whose threads keep
spinning for a while after the copy. When a transfer follows at once (a put staging its tensors into
registered memory, then sending them), those spinning threads take the cores the transport's own
threads need. On a 16-core host a 16 MB Mooncake put of ordinary tensors, staged with torch, ran at
0.46-0.67 of a raw put that makes the same copy with numpy; staged here, at 0.84. A copy here runs
on numpy, which holds no GIL while it moves bytes, split over a few threads of our own that sleep
when idle.
"""

from __future__ import annotations

import numpy as np
import torch

from dataplane._threads import LazyPool, usable_cpus

__all__ = ["copy_bytes", "gather_bytes", "merge_spans"]

_SPLIT_MIN = 4 << 20  # copies from this size on are split; each piece is at least this large
_MAX_THREADS = 4  # memory-bound: a few threads reach the host's copy bandwidth
_PAGE = 4096

_HELPERS = LazyPool(_MAX_THREADS - 1, "dataplane-copy")

# A gather of spans averaging fewer elements than this goes by an element index (np.take) instead
# of one slice per span: a slice costs ~0.3 us whatever its size, an indexed element 1-3 ns
# (2-core VM: 32K spans of 20 elements 10.6 -> 1.2 ms; of 300, slices win 0.6 against 0.9 ms).
_INDEX_BELOW = 100
_INDEX_BLOCK = 1 << 20  # elements per index block (8 MB of int64 indices at most)
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


def merge_spans(starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans ``[starts[k], starts[k] + sizes[k])`` laid back to back, merged where one ends where the
    next begins: (where each merged span lands in the back-to-back layout, its start, its size).
    Empty spans are dropped. One vectorized pass: a get of a data-parallel rank's rows has one span
    per row, thousands of them."""
    keep = sizes > 0
    lands = (np.cumsum(sizes) - sizes)[keep]
    starts, sizes = starts[keep], sizes[keep]
    if len(sizes) <= 1:
        return lands, starts, sizes
    cut = np.flatnonzero(starts[1:] != starts[:-1] + sizes[:-1]) + 1
    first = np.concatenate((np.zeros(1, dtype=np.int64), cut))
    return lands[first], starts[first], np.add.reduceat(sizes, first)


def gather_bytes(
    dst: torch.Tensor, src: torch.Tensor, starts: np.ndarray, sizes: np.ndarray, *, merge: bool = True
) -> None:
    """Copy ``src[starts[k] : starts[k] + sizes[k]]`` for every k, back to back, into ``dst`` (uint8
    tensors; ``dst`` holds exactly ``sizes.sum()`` bytes), merged by :func:`merge_spans` unless the
    caller did (``merge=False``: no empty span, none that ends where the next begins). Many
    spans go through one ``np.concatenate``, or, when they are short (a few dozen elements: the rows of
    a batch of many short rows), one ``np.take`` over an element index: either a fraction of the cost
    of a Python loop of slice copies."""
    if len(sizes) > 1 and merge:
        _, starts, sizes = merge_spans(starts, sizes)
    if len(sizes) == 1:
        s = int(starts[0])
        dst.copy_(src[s : s + int(sizes[0])])
    elif len(sizes):
        low = int(np.bitwise_or.reduce(starts) | np.bitwise_or.reduce(sizes))
        word = next(w for w in _WORDS if low % w == 0)  # widest word every span is made of
        if dst.numel() // word < _INDEX_BELOW * len(sizes):
            _take(dst.numpy(), src.numpy(), starts // word, sizes // word, word)
            return
        s_np = src.numpy()
        pieces = [s_np[s : s + m] for s, m in zip(starts.tolist(), sizes.tolist(), strict=True)]
        np.concatenate(pieces, out=dst.numpy())


def _take(dst: np.ndarray, src: np.ndarray, starts: np.ndarray, sizes: np.ndarray, word: int) -> None:
    """:func:`gather_bytes` by element index, in words of ``word`` bytes (``starts`` and ``sizes`` in
    words), a block of at most ``_INDEX_BLOCK`` words (or one span) at a time."""
    d = dst.view(_WORDS[word])
    s = src[: src.size // word * word].view(_WORDS[word])
    ends = np.cumsum(sizes)
    lands = ends - sizes
    i, n = 0, len(sizes)
    while i < n:
        j = max(i + 1, int(np.searchsorted(ends, lands[i] + _INDEX_BLOCK, side="right")))
        at, upto = int(lands[i]), int(ends[j - 1])
        idx = np.repeat(starts[i:j] - (lands[i:j] - at), sizes[i:j])
        idx += np.arange(upto - at, dtype=np.int64)
        np.take(s, idx, out=d[at:upto])
        i = j
