"""Preshard: every row in exactly one shard, equal microbatch counts, budget held, restore_order inverts."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from dataplane.errors import InvalidArgument, SchemaError
from dataplane.meta import KVBatchMeta
from dataplane.preshard import ShardPlan, plan_shards, restore_order, shard_meta_for_dp

DISTS = ("lognormal", "equal", "one_huge", "many_zeros", "ascending", "descending", "uniform", "bimodal")


def make_lengths(dist: str, n: int, seed: int) -> list[int]:
    """Realistic long-tailed and adversarial length sets."""
    rng = np.random.default_rng(seed)
    if dist == "lognormal":
        x = np.clip(rng.lognormal(6.0, 1.2, n), 1, 32768)
    elif dist == "equal":
        x = np.full(n, rng.integers(0, 4096))
    elif dist == "one_huge":
        x = rng.integers(1, 200, n)
        x[rng.integers(0, n)] = 100_000
    elif dist == "many_zeros":
        x = np.where(rng.random(n) < 0.8, 0, rng.integers(1, 3000, n))
    elif dist == "ascending":
        x = np.sort(rng.integers(0, 8192, n))
    elif dist == "descending":
        x = np.sort(rng.integers(0, 8192, n))[::-1]
    elif dist == "uniform":
        x = rng.integers(0, 8192, n)
    else:
        x = np.where(rng.random(n) < 0.9, rng.integers(10, 100, n), rng.integers(6000, 9000, n))
    return [int(v) for v in x]


@st.composite
def batches(draw: st.DrawFn, max_rows: int = 4096) -> list[int]:
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(st.integers(0, 5000), min_size=1, max_size=48))
    n = draw(st.integers(1, draw(st.sampled_from([16, 128, 1024, max_rows]))))
    return make_lengths(draw(st.sampled_from(DISTS)), n, draw(st.integers(0, 2**32 - 1)))


def meta_of(lengths: list[int]) -> KVBatchMeta:
    keys = [f"u{i}_g0" for i in range(len(lengths))]
    tags = [{"row": i, "len": x} for i, x in enumerate(lengths)]
    return KVBatchMeta(partition_id="train", keys=keys, sequence_lengths=lengths, tags=tags, extra_info={"step": 3})


def options(draw: st.DrawFn, lengths: list[int]) -> dict[str, Any]:
    budget = draw(st.one_of(st.none(), st.integers(1, 2 * max(max(lengths), 1)), st.integers(4096, 65536)))
    return {
        "max_tokens_per_microbatch": budget,
        "equal_rows": draw(st.booleans()),
        "pad_to_multiple": draw(st.sampled_from([1, 8, 64])),
        "sequence_length_round": draw(st.sampled_from([1, 16, 128])),
        "microbatch_order": draw(st.sampled_from(["planned", "largest_first"])),
    }


def check_shards(meta: KVBatchMeta, shards: list[KVBatchMeta], dp: int, opts: dict[str, Any]) -> None:
    lengths = list(meta.sequence_lengths or ())
    n = len(lengths)
    assert len(shards) == dp
    seen = sorted(i for s in shards for i in s.extra_info["original_indices"])
    assert seen == list(range(n)), "every row in exactly one shard"
    multiple = math.lcm(opts.get("pad_to_multiple", 1), opts.get("sequence_length_round", 1))
    pad = -(-max(lengths, default=0) // multiple) * multiple
    for r, s in enumerate(shards):
        info = s.extra_info
        assert info["dp_rank"] == r and info["dp_size"] == dp and info["step"] == 3
        assert info["pad_to_length"] == pad
        idx = info["original_indices"]
        assert s.keys == tuple(meta.keys[i] for i in idx)
        assert s.sequence_lengths == tuple(lengths[i] for i in idx)
        assert s.tags == tuple({"row": i, "len": lengths[i]} for i in idx)
    budget = opts.get("max_tokens_per_microbatch")
    if budget is None:
        assert all(s.extra_info["microbatches"] is None for s in shards)
        return
    counts = {len(s.extra_info["microbatches"]) for s in shards}
    assert len(counts) == 1, f"microbatch counts differ across ranks: {counts}"
    m = counts.pop()
    assert m >= (1 if n else 0)
    for s in shards:
        mbs = s.extra_info["microbatches"]
        assert [i for mb in mbs for i in mb] == list(range(s.size)), "microbatches cover the shard in order"
        sizes = [sum(s.sequence_lengths[i] for i in mb) for mb in mbs]  # type: ignore[index]
        for mb, tokens in zip(mbs, sizes, strict=True):
            assert tokens <= budget or len(mb) == 1, "budget held unless a single oversized row"
            assert mb or n < m * dp, "an empty microbatch only when rows run out"
        if opts.get("microbatch_order") == "largest_first":
            assert sizes == sorted(sizes, reverse=True)


# -- properties ------------------------------------------------------------------------------------
@given(batches(), st.integers(1, 64), st.data())
def test_every_row_in_one_shard_and_plans_hold(lengths: list[int], dp: int, data: st.DataObject) -> None:
    meta = meta_of(lengths)
    opts = options(data.draw, lengths)
    check_shards(meta, shard_meta_for_dp(meta, dp, **opts), dp, opts)


@given(batches(), st.integers(1, 64), st.integers(1, 20000), st.booleans())
def test_budget_gives_equal_microbatch_counts(lengths: list[int], dp: int, budget: int, equal: bool) -> None:
    meta = meta_of(lengths)
    opts = {"max_tokens_per_microbatch": budget, "equal_rows": equal}
    check_shards(meta, shard_meta_for_dp(meta, dp, **opts), dp, opts)


@given(batches(max_rows=1024), st.integers(1, 64), st.data())
def test_restore_order_inverts_the_split(lengths: list[int], dp: int, data: st.DataObject) -> None:
    meta = meta_of(lengths)
    shards = shard_meta_for_dp(meta, dp, **options(data.draw, lengths))
    n = len(lengths)
    full = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    per_rank = [full[s.extra_info["original_indices"]] for s in shards]
    assert torch.equal(restore_order(per_rank, shards), full)
    assert restore_order([list(s.keys) for s in shards], shards) == list(meta.keys)
    tds = [TensorDict({"x": t, "y": t[:, 0].long()}, batch_size=[t.shape[0]]) for t in per_rank]
    back = restore_order(tds, shards)
    assert torch.equal(back["x"], full) and torch.equal(back["y"], full[:, 0].long())
    as_dict = restore_order([{"v": t, "k": list(s.keys)} for t, s in zip(per_rank, shards, strict=True)], shards)
    assert torch.equal(as_dict["v"], full) and as_dict["k"] == list(meta.keys)


@given(batches(), st.integers(1, 64), st.data())
def test_deterministic(lengths: list[int], dp: int, data: st.DataObject) -> None:
    opts = options(data.draw, lengths)
    first = [s.to_dict() for s in shard_meta_for_dp(meta_of(lengths), dp, **opts)]
    again = [s.to_dict() for s in shard_meta_for_dp(meta_of(list(lengths)), dp, **opts)]
    assert first == again


@given(batches(), st.integers(1, 64), st.one_of(st.none(), st.integers(1, 20000)))
def test_equal_rows(lengths: list[int], dp: int, budget: int | None) -> None:
    shards = shard_meta_for_dp(meta_of(lengths), dp, equal_rows=True, max_tokens_per_microbatch=budget)
    counts = [s.size for s in shards]
    n = len(lengths)
    if n % dp == 0:
        assert set(counts) == {n // dp}
    else:  # the first n % dp ranks hold one row more
        assert counts == [n // dp + 1] * (n % dp) + [n // dp] * (dp - n % dp)


@given(batches(), st.integers(1, 64), st.booleans())
def test_imbalance_within_stated_bound(lengths: list[int], dp: int, equal: bool) -> None:
    plan = plan_shards(lengths, dp, equal_rows=equal)
    mean = sum(lengths) / dp
    assert max(plan.rank_tokens) <= mean + max(lengths)
    assert list(plan.rank_tokens) == [sum(lengths[i] for i in r) for r in plan.rows]
    for baseline in ("greedy", "karmarkar_karp"):  # auto keeps the better one (or is within 0.1% of a lower bound)
        other = plan_shards(lengths, dp, equal_rows=equal, algorithm=baseline)
        assert max(plan.rank_tokens) <= max(other.rank_tokens) * 1.001 + 1


@given(st.lists(st.integers(0, 100), min_size=1, max_size=9), st.integers(2, 3))
def test_graham_bound_against_brute_force(lengths: list[int], dp: int) -> None:
    best = min(
        max(sum(x for x, g in zip(lengths, labels, strict=True) if g == r) for r in range(dp))
        for labels in itertools.product(range(dp), repeat=len(lengths))
    )
    got = max(plan_shards(lengths, dp).rank_tokens)
    assert got <= (4 / 3 - 1 / (3 * dp)) * best + 1e-9


@pytest.mark.parametrize("dist", DISTS)
def test_largest_batches(dist: str) -> None:
    lengths = make_lengths(dist, 4096, 11)
    meta = meta_of(lengths)
    for opts in ({}, {"max_tokens_per_microbatch": 8192}, {"max_tokens_per_microbatch": 16384, "equal_rows": True}):
        check_shards(meta, shard_meta_for_dp(meta, 64, **opts), 64, opts)  # type: ignore[arg-type]


# -- examples --------------------------------------------------------------------------------------
def test_docstring_example_and_plan() -> None:
    plan = plan_shards([5, 1, 4, 2], 2, max_tokens_per_microbatch=4)
    assert isinstance(plan, ShardPlan) and plan.dp_size == 2
    assert plan.rank_tokens == (6, 6) and plan.imbalance == 1.0
    assert plan.microbatches == (((0,), (1,)), ((0,), (1,)))


def test_oversized_rows_get_their_own_microbatch() -> None:
    lengths = [9000, 10, 20, 30, 40, 12000, 50, 60]
    shards = shard_meta_for_dp(meta_of(lengths), 2, max_tokens_per_microbatch=100)
    check_shards(meta_of(lengths), shards, 2, {"max_tokens_per_microbatch": 100})
    for s in shards:
        for mb in s.extra_info["microbatches"]:
            if any(s.sequence_lengths[i] > 100 for i in mb):  # type: ignore[index]
                assert len(mb) == 1
    with pytest.raises(InvalidArgument, match="longer than max_tokens_per_microbatch"):
        shard_meta_for_dp(meta_of(lengths), 2, max_tokens_per_microbatch=100, strict=True)


def test_a_rank_needing_fewer_microbatches_still_gets_m_non_empty_ones() -> None:
    lengths = [526, 2439, 1948, 2738, 1511, 1820, 2912, 2188]  # one rank fits 3 bins, the other needs 4
    shards = shard_meta_for_dp(meta_of(lengths), 2, max_tokens_per_microbatch=3000)
    assert {len(s.extra_info["microbatches"]) for s in shards} == {4}
    assert all(mb for s in shards for mb in s.extra_info["microbatches"])


def test_split_fallback_fills_bins_before_leaving_any_empty() -> None:
    from dataplane.balance import _split_to

    values = [5, 4, 3, 2, 1]
    bins = _split_to([[0, 1], [2, 3, 4]], values, 4)
    assert len(bins) == 4 and all(bins) and sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    bins = _split_to([[0, 1], [2, 3, 4]], values, 7)
    assert len(bins) == 7 and sum(1 for b in bins if not b) == 2


def test_rows_move_to_ranks_that_would_have_empty_microbatches() -> None:
    lengths = [1000] + [1] * 30  # balance alone puts the big row alone on one rank
    shards = shard_meta_for_dp(meta_of(lengths), 2, max_tokens_per_microbatch=10)
    m = len(shards[0].extra_info["microbatches"])
    assert all(len(s.extra_info["microbatches"]) == m for s in shards)
    assert all(mb for s in shards for mb in s.extra_info["microbatches"])


def test_empty_microbatches_only_when_rows_run_out() -> None:
    shards = shard_meta_for_dp(meta_of([5, 7, 9]), 4, max_tokens_per_microbatch=100)
    assert [s.size for s in shards] == [1, 1, 1, 0]
    assert [s.extra_info["microbatches"] for s in shards] == [[[0]], [[0]], [[0]], [[]]]
    with pytest.raises(InvalidArgument, match="empty microbatches"):
        shard_meta_for_dp(meta_of([5, 7, 9]), 4, max_tokens_per_microbatch=100, strict=True)


def test_equal_rows_strict_needs_a_divisible_batch() -> None:
    with pytest.raises(InvalidArgument, match="divide by dp_size"):
        shard_meta_for_dp(meta_of([1, 2, 3]), 2, equal_rows=True, strict=True)


def test_long_tail_is_balanced() -> None:
    lengths = make_lengths("lognormal", 512, 7)
    for equal in (False, True):
        assert plan_shards(lengths, 8, equal_rows=equal).imbalance < 1.01


def test_missing_lengths() -> None:
    meta = KVBatchMeta(partition_id="p", keys=[f"k{i}" for i in range(10)])
    with pytest.raises(InvalidArgument, match="no sequence_lengths"):
        shard_meta_for_dp(meta, 2)
    shards = shard_meta_for_dp(meta, 3, missing_lengths="count_rows", max_tokens_per_microbatch=2)
    assert [s.size for s in shards] == [4, 3, 3]
    assert all(s.extra_info["pad_to_length"] is None for s in shards)
    assert {len(s.extra_info["microbatches"]) for s in shards} == {2}


def test_empty_batch() -> None:
    shards = shard_meta_for_dp(
        KVBatchMeta(partition_id="p", keys=[], sequence_lengths=[]), 3, max_tokens_per_microbatch=8
    )
    assert [s.size for s in shards] == [0, 0, 0]
    assert [s.extra_info["microbatches"] for s in shards] == [[], [], []]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp_size": 0}, "dp_size"),
        ({"dp_size": 2, "max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch"),
        ({"dp_size": 2, "pad_to_multiple": 0}, "pad_to_multiple"),
        ({"dp_size": 2, "microbatch_order": "random"}, "microbatch_order"),
        ({"dp_size": 2, "algorithm": "magic"}, "algorithm"),
        ({"dp_size": 2, "missing_lengths": "guess"}, "missing_lengths"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        shard_meta_for_dp(meta_of([1, 2, 3]), **kwargs)


def test_restore_order_nested_and_errors() -> None:
    meta = meta_of([3, 1, 2, 5])
    shards = shard_meta_for_dp(meta, 2)
    rows = [torch.arange(x) for x in (3, 1, 2, 5)]
    per_rank = [
        torch.nested.as_nested_tensor([rows[i] for i in s.extra_info["original_indices"]], layout=torch.jagged)
        for s in shards
    ]
    back = restore_order(per_rank, shards)
    assert [r.tolist() for r in back.unbind()] == [r.tolist() for r in rows]
    with pytest.raises(InvalidArgument, match="rows but its shard has"):
        restore_order([torch.zeros(1), torch.zeros(9)], shards)
    with pytest.raises(SchemaError, match="do not stack"):
        restore_order([torch.zeros(2, 3), torch.zeros(2, 4)], shards)
    with pytest.raises(SchemaError, match="give one type"):
        restore_order([torch.zeros(2), [1, 2]], shards)
    with pytest.raises(InvalidArgument, match="one result per shard"):
        restore_order([torch.zeros(2)], shards)
    with pytest.raises(InvalidArgument, match="original_indices"):
        restore_order([[0, 1], [2, 3]], meta.chunk(2))
    with pytest.raises(InvalidArgument, match="exactly once"):
        restore_order([[0, 1], [2, 3]], [shards[0], shards[0]])


def test_shards_survive_msgpack() -> None:
    meta = meta_of(make_lengths("lognormal", 64, 1))
    for s in shard_meta_for_dp(meta, 4, max_tokens_per_microbatch=4096):
        assert KVBatchMeta.from_msgpack(s.to_msgpack()) == s
