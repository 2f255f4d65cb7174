"""Driver-side sharding of a batch across data-parallel ranks, from sequence lengths alone.

The driver splits one :class:`~dataplane.meta.KVBatchMeta` into one meta per DP rank without
touching a tensor. Two things matter:

* **Token balance.** The slowest rank sets the step time, so rows are spread to even out tokens:
  sorted greedy (LPT) and Karmarkar-Karp largest differencing are both run and the better one kept
  (:mod:`dataplane.balance`).
* **Equal microbatch counts.** With a token budget per microbatch (sequence packing / dynamic
  batching) every rank must run the same number of microbatches: a rank with fewer finishes early
  and then waits forever in the next cross-DP collective. The plan is made here, once, and travels
  in each shard's ``extra_info`` so workers never re-pack locally.

Everything is pure metadata: no I/O, deterministic for the same input.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from tensordict import TensorDictBase

from dataplane.balance import Algorithm, MicrobatchOrder, partition_rows, plan_microbatches
from dataplane.checks import check_int
from dataplane.errors import InvalidArgument, SchemaError
from dataplane.meta import KVBatchMeta

__all__ = ["ShardPlan", "plan_shards", "restore_order", "shard_meta_for_dp"]

log = logging.getLogger(__name__)

MissingLengths = Literal["raise", "count_rows"]
T = TypeVar("T")


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


# -- public API ----------------------------------------------------------------------------------
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
    k = check_int("dp_size", dp_size, low=1, allow_numpy=True)
    multiple = math.lcm(
        check_int("pad_to_multiple", pad_to_multiple, low=1, allow_numpy=True),
        check_int("sequence_length_round", sequence_length_round, low=1, allow_numpy=True),
    )
    budget = (
        None
        if max_tokens_per_microbatch is None
        else check_int("max_tokens_per_microbatch", max_tokens_per_microbatch, low=1, allow_numpy=True)
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
    ranks, name = partition_rows(values, k, equal_rows, algorithm)
    microbatches: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    if budget is None:
        ranks = [sorted(r) for r in ranks]
    else:
        planned = plan_microbatches(ranks, values, budget, equal_rows, strict, microbatch_order)
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
