"""Driver-side sharding of a batch across data-parallel ranks, from sequence lengths alone.

The driver splits one :class:`~dataplane.meta.KVBatchMeta` into one meta per DP rank without
touching a tensor. Two things matter:

* **Token balance.** The slowest rank sets the step time, so rows are spread to even out tokens:
  sorted greedy (LPT) and Karmarkar-Karp largest differencing are both run and the better one kept.
* **Equal microbatch counts.** With a token budget per microbatch (sequence packing / dynamic
  batching) every rank must run the same number of microbatches: a rank with fewer finishes early
  and then waits forever in the next cross-DP collective. The plan is made here, once, and travels
  in each shard's ``extra_info`` so workers never re-pack locally.

Everything is pure metadata: no I/O, deterministic for the same input.
"""

from __future__ import annotations

import heapq
import logging
import math
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from tensordict import TensorDictBase

from dataplane.errors import InvalidArgument, SchemaError
from dataplane.meta import KVBatchMeta

__all__ = ["ShardPlan", "plan_shards", "restore_order", "shard_meta_for_dp"]

log = logging.getLogger(__name__)

Algorithm = Literal["auto", "greedy", "karmarkar_karp"]
MicrobatchOrder = Literal["planned", "largest_first"]
MissingLengths = Literal["raise", "count_rows"]
T = TypeVar("T")

# Karmarkar-Karp runs on at most _KK_ROWS longest rows (the rest are placed greedily after it), and
# on bigger batches only when greedy is not already provably within _GOOD_ENOUGH of the optimum.
_KK_ROWS = 1024
_GOOD_ENOUGH = 1e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """Which rows go to which rank, and (with a token budget) each rank's microbatches.

    Attributes:
        rows: per rank, the row positions in the input batch, in shard order.
        microbatches: per rank, lists of row positions *within the shard*; ``None`` without a budget.
        rank_tokens: tokens per rank (rows per rank when lengths were counted as rows).
        pad_to_length: the global pad length stamped on every shard (``None`` without lengths).
        algorithm: the partition kept: ``"greedy"``, ``"greedy_rounds"`` (equal rows) or ``"karmarkar_karp"``.
    """

    rows: tuple[tuple[int, ...], ...]
    microbatches: tuple[tuple[tuple[int, ...], ...], ...] | None
    rank_tokens: tuple[int, ...]
    pad_to_length: int | None
    algorithm: str

    @property
    def dp_size(self) -> int:
        return len(self.rows)

    @property
    def imbalance(self) -> float:
        """Max-rank tokens over mean-rank tokens (1.0 is perfect; 1.0 for an empty batch)."""
        total = sum(self.rank_tokens)
        return 1.0 if total == 0 else max(self.rank_tokens) * len(self.rank_tokens) / total


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


def _partition(values: list[int], k: int, equal: bool, algorithm: Algorithm) -> tuple[list[list[int]], str]:
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


def _plan_microbatches(
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


# -- public API ----------------------------------------------------------------------------------
def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgument(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def plan_shards(
    sequence_lengths: Sequence[int] | np.ndarray,
    dp_size: int,
    *,
    max_tokens_per_microbatch: int | None = None,
    equal_rows: bool = False,
    pad_to_multiple: int = 1,
    sequence_length_round: int = 1,
    strict: bool = False,
    microbatch_order: MicrobatchOrder = "planned",
    algorithm: Algorithm = "auto",
) -> ShardPlan:
    """The plan behind :func:`shard_meta_for_dp`, from a list of lengths (see there for the options).

    >>> plan = plan_shards([5, 1, 4, 2], 2)
    >>> plan.rows, plan.rank_tokens
    (((0, 1), (2, 3)), (6, 6))
    """
    k = _check_int("dp_size", dp_size, 1)
    multiple = math.lcm(
        _check_int("pad_to_multiple", pad_to_multiple, 1), _check_int("sequence_length_round", sequence_length_round, 1)
    )
    budget = (
        None
        if max_tokens_per_microbatch is None
        else _check_int("max_tokens_per_microbatch", max_tokens_per_microbatch, 1)
    )
    if microbatch_order not in ("planned", "largest_first"):
        raise InvalidArgument(f"microbatch_order must be 'planned' or 'largest_first', got {microbatch_order!r}")
    if algorithm not in ("auto", "greedy", "karmarkar_karp"):
        raise InvalidArgument(f"algorithm must be 'auto', 'greedy' or 'karmarkar_karp', got {algorithm!r}")
    lens = np.asarray(sequence_lengths, dtype=np.int64).reshape(-1)
    n = lens.size
    if n and int(lens.min()) < 0:
        raise InvalidArgument("sequence_lengths must be >= 0")
    values = lens.tolist()
    if strict and equal_rows and n % k:
        raise InvalidArgument(
            f"equal_rows with strict=True needs the batch ({n} rows) to divide by dp_size={k}; "
            "drop or duplicate rows first, or pass strict=False to allow counts that differ by one"
        )
    if strict and budget is not None and n and int(lens.max()) > budget:
        bad = [i for i, v in enumerate(values) if v > budget]
        raise InvalidArgument(
            f"{len(bad)} row(s) are longer than max_tokens_per_microbatch={budget} (row {bad[0]} has "
            f"{values[bad[0]]} tokens); raise the budget, truncate those rows, or pass strict=False to give each its own microbatch"
        )
    ranks, name = _partition(values, k, equal_rows, algorithm)
    microbatches: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    if budget is None:
        ranks = [sorted(r) for r in ranks]
    else:
        planned = _plan_microbatches(ranks, values, budget, equal_rows, strict, microbatch_order)
        ranks = [[i for b in bins for i in b] for bins in planned]
        per_rank = []
        for bins in planned:
            cuts = np.cumsum([0, *(len(b) for b in bins)]).tolist()
            per_rank.append(tuple(tuple(range(cuts[j], cuts[j + 1])) for j in range(len(bins))))
        microbatches = tuple(per_rank)
    longest = int(lens.max()) if n else 0
    return ShardPlan(
        rows=tuple(tuple(r) for r in ranks),
        microbatches=microbatches,
        rank_tokens=tuple(sum(values[i] for i in r) for r in ranks),
        pad_to_length=-(-longest // multiple) * multiple,
        algorithm=name,
    )


def shard_meta_for_dp(
    meta: KVBatchMeta,
    dp_size: int,
    *,
    max_tokens_per_microbatch: int | None = None,
    equal_rows: bool = False,
    pad_to_multiple: int | None = None,
    sequence_length_round: int = 1,
    strict: bool = False,
    microbatch_order: MicrobatchOrder = "planned",
    algorithm: Algorithm = "auto",
    missing_lengths: MissingLengths = "raise",
) -> list[KVBatchMeta]:
    """Split ``meta`` into one meta per DP rank, balanced by tokens, from ``meta.sequence_lengths`` only.

    Balance: sorted greedy (LPT) and Karmarkar-Karp both run and the one with the smaller
    max-rank tokens is kept. Above 1024 rows KK runs on the 1024 longest rows and places the rest
    greedily after them, and only when greedy is not already within 0.1% of a lower bound on the
    optimum. With ``equal_rows`` greedy takes rows up to a per-rank quota, and a round-robin greedy
    and a round-based KK compete with it. Stated bound, without a budget: max-rank tokens <= mean-rank
    tokens + the longest row; without ``equal_rows`` also <= (4/3 - 1/(3*dp_size)) * optimum
    (Graham's bound for LPT, which the kept partition never exceeds).

    ``equal_rows=True`` gives every rank the same row count when ``dp_size`` divides the batch
    (GRPO); otherwise counts differ by at most one, the first ``len(meta) % dp_size`` ranks
    holding the extra row (``strict=True`` raises instead).

    With ``max_tokens_per_microbatch`` every rank also gets a microbatch plan, and **every rank
    the same number of microbatches** ``M`` (total ``M * dp_size``, a multiple of the DP size), so
    no rank waits forever in a collective the others never reach. No microbatch exceeds the budget
    unless it holds a single longer row, which always gets one of its own (``strict=True``
    raises). Microbatches are as even in tokens as the budget allows; bins are split rather than
    left empty, and rows move from ranks with spare rows to ranks with fewer than ``M`` (which can
    cost some token balance). An empty microbatch appears only when the batch has fewer than
    ``M * dp_size`` rows (e.g. fewer rows than ranks); ``strict=True`` raises then.

    Each shard's ``extra_info`` gets ``dp_rank``, ``dp_size``, ``original_indices`` (row positions in
    ``meta``), ``microbatches`` (lists of row positions within the shard, consecutive; ``None``
    without a budget), ``pad_to_length`` (``round_up(longest row, lcm(pad_to_multiple,
    sequence_length_round))``, the same on every shard) and ``pad_to_multiple``.

    Args:
        meta: the batch; needs ``sequence_lengths`` unless ``missing_lengths="count_rows"``.
        dp_size: number of data-parallel ranks.
        max_tokens_per_microbatch: token budget per microbatch, or None for no microbatch plan.
        equal_rows: same row count on every rank (+-1 when the batch does not divide).
        pad_to_multiple: pad length multiple the model needs (TP / CP divisibility); None takes
            ``meta.extra_info["pad_to_multiple"]`` (which ``first_write`` records), else 1.
        sequence_length_round: an extra rounding of the pad length (kernel-friendly widths).
        strict: raise ``InvalidArgument`` instead of relaxing a guarantee (see above).
        microbatch_order: ``"planned"`` (by first row in input order) or ``"largest_first"`` (most
            tokens first, so the first microbatch shows the peak memory).
        algorithm: ``"auto"`` (better of both), ``"greedy"`` or ``"karmarkar_karp"``.
        missing_lengths: ``"raise"`` (default) or ``"count_rows"``: balance rows, a budget then
            counts rows per microbatch, and ``pad_to_length`` is None.

    Returns:
        ``dp_size`` metas, shard ``r`` for rank ``r``.

    >>> m = KVBatchMeta(partition_id="train", keys=list("abcd"), sequence_lengths=[5, 1, 4, 2])
    >>> shards = shard_meta_for_dp(m, 2, max_tokens_per_microbatch=4)
    >>> [s.keys for s in shards], [s.extra_info["microbatches"] for s in shards]
    ([('a', 'b'), ('c', 'd')], [[[0], [1]], [[0], [1]]])
    """
    if not isinstance(meta, KVBatchMeta):
        raise SchemaError(f"shard_meta_for_dp needs a KVBatchMeta, got {type(meta).__name__}")
    if missing_lengths not in ("raise", "count_rows"):
        raise InvalidArgument(f"missing_lengths must be 'raise' or 'count_rows', got {missing_lengths!r}")
    lengths: Sequence[int] | None = meta.sequence_lengths
    if lengths is None:
        if missing_lengths == "raise":
            raise InvalidArgument(
                "meta has no sequence_lengths, so tokens cannot be balanced; write token fields with "
                "dataplane.columns.first_write (it records them), build the meta with sequence_lengths=..., "
                "or pass missing_lengths='count_rows' to balance row counts"
            )
        lengths = [1] * meta.size
    if pad_to_multiple is None:
        pad_to_multiple = int(meta.extra_info.get("pad_to_multiple", 1))
    plan = plan_shards(
        lengths,
        dp_size,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        equal_rows=equal_rows,
        pad_to_multiple=pad_to_multiple,
        sequence_length_round=sequence_length_round,
        strict=strict,
        microbatch_order=microbatch_order,
        algorithm=algorithm,
    )
    log.debug(
        "preshard: %d rows over %d ranks, imbalance %.4f (%s)", meta.size, dp_size, plan.imbalance, plan.algorithm
    )
    return [
        meta.subset(rows).with_extra_info(
            dp_rank=r,
            dp_size=plan.dp_size,
            original_indices=list(rows),
            microbatches=None if plan.microbatches is None else [list(b) for b in plan.microbatches[r]],
            pad_to_length=None if meta.sequence_lengths is None else plan.pad_to_length,
            pad_to_multiple=math.lcm(pad_to_multiple, sequence_length_round),  # checked by plan_shards
        )
        for r, rows in enumerate(plan.rows)
    ]


def _indices_of(shards: Sequence[KVBatchMeta]) -> list[list[int]]:
    out = []
    for r, s in enumerate(shards):
        idx = s.extra_info.get("original_indices") if isinstance(s, KVBatchMeta) else None
        if idx is None:
            raise InvalidArgument(
                f"shard {r} has no extra_info['original_indices']; pass the metas shard_meta_for_dp returned"
            )
        out.append([int(i) for i in idx])
    flat = sorted(i for idx in out for i in idx)
    if flat != list(range(len(flat))):
        raise InvalidArgument(
            "the shards' original_indices do not cover the batch exactly once; pass all shards of one split"
        )
    return out


def _kind(value: object) -> str | None:
    if isinstance(value, TensorDictBase):
        return "tensordict"
    if isinstance(value, torch.Tensor):
        return "nested" if value.is_nested else "tensor"
    if isinstance(value, Mapping):
        return "mapping"
    return "list" if isinstance(value, (list, tuple)) else None


def _restore(parts: Sequence[Any], sizes: list[int], inverse: torch.Tensor, where: str) -> Any:
    kind = _kind(parts[0])
    if kind is None:
        raise SchemaError(
            f"{where}: cannot restore {type(parts[0]).__name__}; give tensors, TensorDicts, lists or dicts"
        )
    for r, (p, n) in enumerate(zip(parts, sizes, strict=True)):
        if _kind(p) != kind:
            raise SchemaError(
                f"{where}: rank {r} gives {type(p).__name__}, rank 0 {type(parts[0]).__name__}; give one type"
            )
        if kind == "mapping":
            if set(p) != set(parts[0]):
                raise SchemaError(f"{where}: rank {r} gives keys {sorted(p)}, rank 0 {sorted(parts[0])}")
            continue
        rows = p.batch_size[0] if kind == "tensordict" else len(p)
        if rows != n:
            raise InvalidArgument(f"{where}: rank {r} returned {rows} rows but its shard has {n}; return one per row")
    if kind == "mapping":
        return {key: _restore([p[key] for p in parts], sizes, inverse, f"{where}[{key!r}]") for key in parts[0]}
    if kind in ("list", "nested"):
        rows = [row for p in parts for row in (p.unbind() if kind == "nested" else p)]
        ordered = [rows[i] for i in inverse.tolist()]
        return ordered if kind == "list" else torch.nested.as_nested_tensor(ordered, layout=parts[0].layout)
    try:
        return torch.cat(list(parts))[inverse.to(parts[0].device)]
    except RuntimeError as e:
        raise SchemaError(
            f"{where}: per-rank results do not stack ({e}); pad every rank to the shards' pad_to_length "
            "so all share one shape past the batch dim"
        ) from None


def restore_order(per_rank_results: Sequence[T], shards: Sequence[KVBatchMeta]) -> T:
    """Put per-rank results back into the order of the batch that was sharded.

    ``per_rank_results[r]`` is rank ``r``'s output, one row per row of ``shards[r]`` in shard order:
    a tensor (batch first; nested tensors too), a TensorDict, a list, or a dict of those.

    >>> m = KVBatchMeta(partition_id="train", keys=list("abc"), sequence_lengths=[1, 9, 2])
    >>> shards = shard_meta_for_dp(m, 2)
    >>> restore_order([list(s.keys) for s in shards], shards)
    ['a', 'b', 'c']
    """
    if len(per_rank_results) != len(shards) or not shards:
        raise InvalidArgument(
            f"got {len(per_rank_results)} results for {len(shards)} shards; give one result per shard"
        )
    indices = _indices_of(shards)
    order = torch.tensor([i for idx in indices for i in idx], dtype=torch.int64)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    out: T = _restore(per_rank_results, [len(i) for i in indices], inverse, "restore_order")
    return out
