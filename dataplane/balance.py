"""Integer balancing behind :mod:`dataplane.preshard`: split row lengths into ``k`` groups of nearly
equal sums, and pack each group into the same number of bins under a budget.

* :func:`partition_rows`: rows -> ``k`` groups (ranks), balanced by their values (tokens). Sorted
  greedy (LPT) and Karmarkar-Karp largest differencing are both run and the better one kept; with
  ``equal`` every group gets the same number of rows (within one).
* :func:`plan_microbatches`: each group's rows -> bins (microbatches) of at most ``budget``, the same
  bin count on every group (unequal counts deadlock the first cross-rank collective).

Pure functions over lists of ints; deterministic for the same input.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from typing import Literal

import numpy as np

from dataplane.errors import InvalidArgument

__all__ = ["Algorithm", "MicrobatchOrder", "partition_rows", "plan_microbatches"]

Algorithm = Literal["auto", "greedy", "karmarkar_karp"]
MicrobatchOrder = Literal["planned", "largest_first"]

# Karmarkar-Karp runs on at most _KK_ROWS longest rows (the rest are placed greedily after it), and
# on bigger batches only when greedy is not already provably within _GOOD_ENOUGH of the optimum.
_KK_ROWS = 1024
_GOOD_ENOUGH = 1e-3


# -- partition rows into k groups ----------------------------------------------------------------


def _lower_bound(desc: np.ndarray, k: int) -> int:
    """A lower bound on the best max-group sum: mean, and pigeonhole over the j largest rows."""
    n = desc.size
    if n == 0:
        return 0
    prefix = np.concatenate(([0], np.cumsum(desc)))
    j = np.arange(1, n + 1)
    # Some group holds ceil(j/k) of the j largest rows, so at least the smallest ceil(j/k) of them.
    best = int((prefix[j] - prefix[j - (-(-j // k))]).max())
    return max(best, -(-int(prefix[-1]) // k))


def _greedy(values: list[int], order: list[int], k: int, equal: bool) -> list[int]:
    """Sorted greedy (LPT): each row, longest first, goes to the least-loaded group.

    With ``equal`` a group takes rows only while it is below its quota (``n // k``, and ``n % k``
    groups one more), so counts differ by at most one. Heap keys encode ``(load, rows, group)`` as
    one int (ties go to the group with fewer rows, which spreads zero-length rows).
    """
    n = len(values)
    labels = [0] * n
    heap = list(range(k))
    step = n + 1
    if not equal:
        for i in order:
            key = heap[0]
            labels[i] = key % k
            heapq.heapreplace(heap, key + (values[i] * step + 1) * k)
        return labels
    quota, extra = divmod(n, k)
    counts = [0] * k
    for i in order:
        while True:
            key = heap[0]
            c = counts[key % k]
            if c < quota or (c == quota and extra > 0):
                break
            heapq.heappop(heap)  # this group is full
        g = key % k
        labels[i] = g
        counts[g] = c + 1
        extra -= c == quota
        heapq.heapreplace(heap, key + (values[i] * step + 1) * k)
    return labels


def _greedy_rounds(values: list[int], order: list[int], k: int) -> list[int]:
    """Equal-count greedy in rounds of ``k`` rows (longest to least loaded, one row per group).

    In each round the spread between groups grows by at most the round's own spread, so
    ``max - min <= longest row``: the bound :func:`shard_meta_for_dp` states for ``equal_rows``.
    """
    loads = np.zeros(k, dtype=np.int64)
    lens = np.asarray(values, dtype=np.int64)
    idx = np.asarray(order, dtype=np.int64)
    out = np.empty(len(values), dtype=np.int64)
    for start in range(0, idx.size, k):
        chunk = idx[start : start + k]
        targets = np.argsort(loads, kind="stable")[: chunk.size]
        out[chunk] = targets
        loads[targets] += lens[chunk]
    labels: list[int] = out.tolist()
    return labels


def _karmarkar_karp(values: list[int], order: list[int], k: int, head: int) -> list[int]:
    """Multi-way largest differencing on the ``head`` longest rows; the rest then go greedily.

    A partial partition is a list of ``(sum, slot)`` sorted descending, kept sparse (zero sums
    implicit); a slot id below ``n`` is a row, above it a union of two slots. Merging the two
    partitions with the largest spread pairs the heaviest slots of one with the lightest of the
    other. Rows past ``head`` (the short tail of a big batch, where KK costs most and gains least)
    go longest first onto the least-loaded group.
    """
    n = len(values)
    top, tail = order[:head], order[head:]
    parts: list[list[tuple[int, int]]] = [[(values[i], i)] for i in top]
    heap = [(-values[i], j) for j, i in enumerate(top)]
    heapq.heapify(heap)
    left: list[int] = []
    right: list[int] = []
    while len(heap) > 1:
        a, b = parts[heapq.heappop(heap)[1]], parts[heapq.heappop(heap)[1]]
        ma, mb = len(a), len(b)
        merged = a[: k - mb] + b[: k - ma] if ma + mb > k else a + b
        for j in range(max(k - mb, 0), ma):
            (sa, xa), (sb, xb) = a[j], b[k - 1 - j]
            merged.append((sa + sb, n + len(left)))
            left.append(xa)
            right.append(xb)
        merged.sort(reverse=True)
        heapq.heappush(heap, (merged[-1][0] - merged[0][0] if len(merged) == k else -merged[0][0], len(parts)))
        parts.append(merged)
    labels = [0] * n
    loads, counts = [0] * k, [0] * k
    for group, (total, slot) in enumerate(parts[heap[0][1]] if heap else []):
        loads[group] = total
        stack = [slot]
        while stack:
            s = stack.pop()
            if s < n:
                labels[s] = group
                counts[group] += 1
            else:
                stack += (left[s - n], right[s - n])
    step = n + 1
    keys = [(loads[g] * step + counts[g]) * k + g for g in range(k)]
    heapq.heapify(keys)
    for i in tail:
        key = keys[0]
        labels[i] = key % k
        heapq.heapreplace(keys, key + (values[i] * step + 1) * k)
    return labels


def _karmarkar_karp_equal(values: list[int], order: list[int], k: int) -> list[int]:
    """Largest differencing that starts from rounds of ``k`` sorted rows, one per slot, so every
    group ends with the same count (+-1; the last round is padded with zero-length dummies)."""
    n = len(values)
    rounds = -(-n // k)
    ids = np.full(rounds * k, -1, dtype=np.int64)  # -1: dummy (writes to it land in a spare slot)
    ids[:n] = order
    sums = np.where(ids >= 0, np.asarray(values, dtype=np.int64)[ids], 0).reshape(rounds, k)
    parts = list(zip(sums, ids.reshape(rounds, k), strict=True))
    heap = [(int(s[-1] - s[0]), j) for j, s in enumerate(sums)]
    heapq.heapify(heap)
    merges: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    nxt = n
    while len(heap) > 1:
        (sa, ia), (sb, ib) = parts[heapq.heappop(heap)[1]], parts[heapq.heappop(heap)[1]]
        merged = sa + sb[::-1]
        new = np.arange(nxt, nxt + k)
        nxt += k
        merges.append((new, ia, ib[::-1]))
        perm = np.argsort(-merged, kind="stable")
        heapq.heappush(heap, (int(merged[perm[-1]] - merged[perm[0]]), len(parts)))
        parts.append((merged[perm], new[perm]))
    group = np.zeros(nxt + 1, dtype=np.int64)
    if heap:
        group[parts[heap[0][1]][1]] = np.arange(k)
    for new, ia, ib in reversed(merges):
        group[ia] = group[new]
        group[ib] = group[new]
    labels: list[int] = group[:n].tolist()
    return labels


def partition_rows(values: list[int], k: int, equal: bool, algorithm: Algorithm) -> tuple[list[list[int]], str]:
    """Rows per rank (each list longest first) and the name of the partition kept.

    Ranks are numbered by (more rows first, more tokens first, earliest row first).
    """
    n = len(values)
    lens = np.asarray(values, dtype=np.int64)
    order_np = np.argsort(-lens, kind="stable")
    order = order_np.tolist()
    candidates: list[tuple[str, list[int]]] = []
    if algorithm != "karmarkar_karp":
        candidates.append(("greedy", _greedy(values, order, k, equal)))
        if equal:
            candidates.append(("greedy_rounds", _greedy_rounds(values, order, k)))

    def score(c: tuple[str, list[int]]) -> tuple[int, int]:
        loads = np.bincount(np.asarray(c[1], dtype=np.int64), weights=lens, minlength=k) if n else np.zeros(k)
        return int(loads.max()), int(loads.max() - loads.min())

    best = min(candidates, key=score) if candidates else None
    if algorithm == "karmarkar_karp" or (
        algorithm == "auto"
        and best is not None
        and (n <= _KK_ROWS or score(best)[0] > _lower_bound(lens[order_np], k) * (1 + _GOOD_ENOUGH))
    ):
        kk = _karmarkar_karp_equal(values, order, k) if equal else _karmarkar_karp(values, order, k, _KK_ROWS)
        candidates.append(("karmarkar_karp", kk))
    name, labels = min(candidates, key=score)  # ties keep the earlier candidate
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        groups[labels[i]].append(i)
    loads = np.bincount(np.asarray(labels, dtype=np.int64), weights=lens, minlength=k).tolist() if n else [0] * k
    ranked = sorted(range(k), key=lambda g: (-len(groups[g]), -loads[g], min(groups[g], default=n)))
    return [groups[g] for g in ranked], name


# -- microbatches of one rank --------------------------------------------------------------------
def _best_fit_decreasing(rows: list[int], values: list[int], budget: int) -> list[list[int]]:
    """Bins of at most ``budget`` tokens; ``rows`` longest first, none longer than the budget."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), ascending
    for i in rows:
        pos = bisect_left(free, (values[i], -1))
        if pos < len(free):
            room, b = free.pop(pos)
            bins[b].append(i)
            insort(free, (room - values[i], b))
        else:
            bins.append([i])
            insort(free, (budget - values[i], len(bins) - 1))
    return bins


def _lpt_bins(rows: list[int], values: list[int], m: int) -> tuple[list[list[int]], int]:
    """``rows`` (longest first) into ``m`` bins of even tokens; returns the bins and the peak load.

    Ties go to the bin with fewer rows, so no bin stays empty while another holds two rows.
    """
    bins: list[list[int]] = [[] for _ in range(m)]
    heap = list(range(m))  # (load, rows, bin) encoded as one int
    step = len(rows) + 1
    for i in rows:
        key = heap[0]
        bins[key % m].append(i)
        heapq.heapreplace(heap, key + (values[i] * step + 1) * m)
    return bins, max(heap) // m // step


def _split_to(bins: list[list[int]], values: list[int], m: int) -> list[list[int]]:
    """Split the heaviest multi-row bins in two until there are ``m`` bins (pad with empty ones)."""
    bins = list(bins)
    heap = [(-sum(values[i] for i in b), j) for j, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < m and heap:
        _, j = heapq.heappop(heap)
        halves, _ = _lpt_bins(bins[j], values, 2)
        bins[j] = halves[0]
        bins.append(halves[1])
        for pos in (j, len(bins) - 1):
            if len(bins[pos]) > 1:
                heapq.heappush(heap, (-sum(values[i] for i in bins[pos]), pos))
    return bins + [[] for _ in range(m - len(bins))]


def _pack_rank(rows: list[int], values: list[int], budget: int, m: int) -> list[list[int]] | int:
    """Exactly ``m`` bins of at most ``budget`` tokens (a longer row alone), or the count it needs.

    Oversized rows get a bin each; the rest go longest-first into the least-loaded bin (even
    microbatches); if that breaks the budget, best-fit decreasing is split up to ``m``. A bin is
    empty only when the rank has fewer than ``m`` rows.
    """
    big = [[i] for i in rows if values[i] > budget]
    rest = [i for i in rows if values[i] <= budget]
    open_bins = m - len(big)
    if open_bins < (1 if rest else 0):
        return len(big) + (1 if rest else 0)
    if open_bins == 0:
        return big
    bins, peak = _lpt_bins(rest, values, open_bins)
    if peak > budget:
        fitted = _best_fit_decreasing(rest, values, budget)
        if len(fitted) > open_bins:
            return len(big) + len(fitted)
        bins = _split_to(fitted, values, open_bins)
    return big + bins


def _fewest_bins(rows: list[int], values: list[int], budget: int) -> int:
    big = sum(1 for i in rows if values[i] > budget)
    tokens = sum(values[i] for i in rows if values[i] <= budget)
    return big + max(-(-tokens // budget), 1 if len(rows) > big else 0)


def _fill_short_ranks(ranks: list[list[int]], values: list[int], m: int) -> None:
    """Move the shortest rows of the heaviest ranks with more than ``m`` rows to ranks with fewer.

    Stops when no rank can spare a row, so the number of empty microbatches is the fewest possible.
    """
    loads = [sum(values[i] for i in r) for r in ranks]
    for dst, target in enumerate(ranks):
        while len(target) < m:
            donors = [g for g in range(len(ranks)) if len(ranks[g]) > m]
            if not donors:
                break
            src = max(donors, key=lambda g: (loads[g], -g))
            row = ranks[src].pop()  # rows are kept longest first: this is the shortest
            loads[src] -= values[row]
            loads[dst] += values[row]
            target.append(row)
        target.sort(key=lambda i: (-values[i], i))


def plan_microbatches(
    ranks: list[list[int]], values: list[int], budget: int, equal_rows: bool, strict: bool, order: MicrobatchOrder
) -> list[list[list[int]]]:
    """Every rank's bins (row positions in the batch), the same count ``M`` on every rank."""
    n, k = len(values), len(ranks)
    m = 1 if n else 0
    while True:
        m = max([m, *(_fewest_bins(r, values, budget) for r in ranks)])
        if not equal_rows and any(len(r) < m for r in ranks) and any(len(r) > m for r in ranks):
            _fill_short_ranks(ranks, values, m)
            continue
        packed = [_pack_rank(r, values, budget, m) for r in ranks]
        need = max([m, *(p for p in packed if isinstance(p, int))])
        if need == m:
            break
        m = need  # best-fit needed more bins on some rank: every rank gets that many
    if strict and n < m * k:
        raise InvalidArgument(
            f"{n} rows cannot fill {m} microbatches on each of {k} ranks without empty microbatches; "
            "use a smaller dp_size or no token budget, or pass strict=False to allow empty microbatches"
        )
    out = []
    for pack in packed:
        assert not isinstance(pack, int)
        bins = [sorted(b) for b in pack]
        if order == "largest_first":
            bins.sort(key=lambda b: (-sum(values[i] for i in b), b[0] if b else n))
        else:
            bins.sort(key=lambda b: b[0] if b else n)
        out.append(bins)
    return out
