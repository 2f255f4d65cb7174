"""integrations.rl.advantages and .conventions against per-row python reference loops."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dataplane import InvalidArgument
from integrations.rl import conventions as c
from integrations.rl.advantages import (
    explained_variance,
    gae,
    group_advantages,
    right_shift,
    sequence_gae,
    value_fit_sums,
)

jagged_lengths = st.lists(st.integers(1, 64), min_size=1, max_size=32)
seeds = st.integers(0, 2**31 - 1)
unit = st.floats(0.0, 1.0, allow_nan=False)


def rows(lengths: Sequence[int], seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=dtype) for n in lengths]


def jag(rs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(list(rs), layout=torch.jagged)


# -- references (float64, one row at a time) ------------------------------------------------------
def ref_group(rewards: list[float], ids: Sequence[Hashable], normalize_std: bool, eps: float, loo: bool) -> list[float]:
    out = []
    for r, g in zip(rewards, ids, strict=True):
        members = [x for x, h in zip(rewards, ids, strict=True) if h == g]
        n = len(members)
        if n == 1 or min(members) == max(members):
            out.append(0.0)
            continue
        mean = sum(members) / n
        base = (sum(members) - r) / (n - 1) if loo else mean
        a = r - base
        if normalize_std:
            a /= math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1)) + eps
        out.append(a)
    return out


def ref_gae(r: list[float], v: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    n = len(r)
    adv = [0.0] * n
    running = 0.0
    for t in reversed(range(n)):
        next_v = v[t + 1] if t + 1 < n else 0.0
        running = r[t] + gamma * next_v - v[t] + gamma * lam * running
        adv[t] = running
    return adv, [a + b for a, b in zip(adv, v, strict=True)]


# -- group_advantages -----------------------------------------------------------------------------
@given(
    ids=st.lists(st.integers(0, 6), min_size=1, max_size=32),
    seed=seeds,
    normalize_std=st.booleans(),
    loo=st.booleans(),
    ties=st.booleans(),
)
def test_group_advantages_matches_reference(
    ids: list[int], seed: int, normalize_std: bool, loo: bool, ties: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(ids), generator=g, dtype=torch.float64)
    if ties:  # binary rewards: constant groups and repeated values are common
        rewards = (rewards > 0).to(torch.float64)
    got = group_advantages(rewards, ids, normalize_std=normalize_std, leave_one_out=loo)
    want = torch.tensor(ref_group(rewards.tolist(), ids, normalize_std, 1e-6, loo), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert got.dtype == torch.float64


@given(ids=st.lists(st.integers(0, 5), min_size=2, max_size=32), seed=seeds, loo=st.booleans())
def test_group_advantages_other_groups_bitwise_unchanged(ids: list[int], seed: int, loo: bool) -> None:
    rewards = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
    before = group_advantages(rewards, ids, leave_one_out=loo)
    perturbed = rewards.clone()
    perturbed[0] += 3.5
    after = group_advantages(perturbed, ids, leave_one_out=loo)
    others = torch.tensor([i != ids[0] for i in ids])
    assert torch.equal(before[others], after[others])


def test_group_advantages_any_hashable_ids_any_order() -> None:
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 3.0, 5.0, 7.0])
    ids: list[Hashable] = ["a", ("b", 1), "a", ("b", 1), "a", 9, ("b", 1)]
    got = group_advantages(rewards, ids)
    perm = [6, 2, 0, 5, 3, 1, 4]
    shuffled = group_advantages(rewards[perm], [ids[i] for i in perm])
    torch.testing.assert_close(shuffled, got[perm], rtol=0, atol=0)
    torch.testing.assert_close(got, torch.tensor(ref_group(rewards.tolist(), ids, True, 1e-6, False)).float())
    assert got[5] == 0  # a group of one
    # tensor ids work like their python values
    torch.testing.assert_close(group_advantages(rewards, torch.tensor([0, 1, 0, 1, 0, 2, 1])), got)


def test_group_advantages_degenerate_groups_are_zero() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 7.0, 1.0, 0.0])
    got = group_advantages(rewards, ["c", "c", "c", "one", "x", "x"])
    assert got[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert got[4] > 0 > got[5]
    assert group_advantages(torch.tensor([]), []).shape == (0,)


def test_group_advantages_leave_one_out() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    got = group_advantages(rewards, [0, 0, 0, 0], normalize_std=False, leave_one_out=True)
    torch.testing.assert_close(got, torch.tensor([0.0, -4 / 3, -4 / 3, 8 / 3], dtype=torch.float64))


@pytest.mark.parametrize(
    ("rewards", "ids", "kwargs", "match"),
    [
        (torch.tensor([[1.0]]), [0], {}, "1-D floating"),
        (torch.tensor([1, 2]), [0, 0], {}, "1-D floating"),
        (torch.tensor([1.0, 2.0]), [0], {}, "one id per row"),
        (torch.tensor([1.0]), [[0]], {}, "hashable"),
        (torch.tensor([1.0]), [0], {"eps": -1.0}, "eps"),
    ],
)
def test_group_advantages_validation(
    rewards: torch.Tensor, ids: list[object], kwargs: dict[str, float], match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        group_advantages(rewards, ids, **kwargs)  # type: ignore[arg-type]


# -- right_shift / shift_to_tokens ----------------------------------------------------------------
@given(lengths=jagged_lengths, seed=seeds)
def test_right_shift_matches_reference(lengths: list[int], seed: int) -> None:
    rs = rows(lengths, seed)
    got = right_shift(jag(rs)).unbind()
    assert [len(x) for x in got] == lengths
    for row, out in zip(rs, got, strict=True):
        assert torch.equal(out, torch.cat([torch.zeros(1), row[:-1]]))
    # the nested path of shift_to_tokens is the same function
    for a, b in zip(c.shift_to_tokens(jag(rs)).unbind(), got, strict=True):
        assert torch.equal(a, b)


def test_right_shift_noncontiguous_and_trailing_dims() -> None:
    padded = torch.arange(12.0).reshape(3, 4)
    view = torch.nested.narrow(padded, 1, torch.tensor([0, 0, 0]), torch.tensor([2, 4, 1]), layout=torch.jagged)
    got = [r.tolist() for r in right_shift(view).unbind()]
    assert got == [[0.0, 0.0], [0.0, 4.0, 5.0, 6.0], [0.0]]
    empty_rows = jag([torch.ones(2), torch.zeros(0), torch.full((3,), 2.0), torch.zeros(0)])
    assert [r.tolist() for r in right_shift(empty_rows).unbind()] == [[0.0, 1.0], [], [0.0, 2.0, 2.0], []]
    adv, _ = gae(empty_rows, empty_rows, gamma=1.0, lam=1.0)
    assert [len(r) for r in adv.unbind()] == [2, 0, 3, 0]
    nt = jag([torch.ones(2, 3), torch.full((1, 3), 2.0)])
    out = right_shift(nt).unbind()
    assert torch.equal(out[0], torch.tensor([[0.0] * 3, [1.0] * 3])) and torch.equal(out[1], torch.zeros(1, 3))


def test_shift_to_tokens_padded() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    assert torch.equal(c.shift_to_tokens(x), torch.tensor([[0.0, 1.0, 2.0], [0.0, 4.0, 5.0]]))
    x3 = torch.arange(12.0).reshape(2, 3, 2)
    want = torch.cat([torch.zeros(2, 1, 2), x3[:, :-1]], dim=1)
    assert torch.equal(c.shift_to_tokens(x3), want)
    assert c.shift_to_tokens(torch.zeros(0, 5)).shape == (0, 5)
    with pytest.raises(InvalidArgument, match="unsqueeze"):
        c.shift_to_tokens(torch.zeros(3))
    with pytest.raises(InvalidArgument, match="jagged"):
        right_shift(torch.zeros(2, 3))


# -- gae ------------------------------------------------------------------------------------------
@given(lengths=jagged_lengths, seed=seeds, gamma=unit, lam=unit)
def test_gae_matches_reference(lengths: list[int], seed: int, gamma: float, lam: float) -> None:
    r_rows, v_rows = rows(lengths, seed), rows(lengths, seed + 1)
    adv, ret = gae(jag(r_rows), jag(v_rows), gamma=gamma, lam=lam)
    assert adv.is_nested and ret.is_nested
    for r, v, a, R in zip(r_rows, v_rows, adv.unbind(), ret.unbind(), strict=True):
        want_a, want_r = ref_gae(r.double().tolist(), v.double().tolist(), gamma, lam)
        torch.testing.assert_close(a.double(), torch.tensor(want_a, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(R.double(), torch.tensor(want_r, dtype=torch.float64), rtol=1e-5, atol=1e-5)


@given(lengths=st.lists(st.integers(1, 64), min_size=2, max_size=16), seed=seeds, gamma=unit, lam=unit, data=st.data())
def test_no_value_crosses_rows(lengths: list[int], seed: int, gamma: float, lam: float, data: st.DataObject) -> None:
    """Perturb one row (values and even its length): every other row's outputs stay bitwise equal."""
    i = data.draw(st.integers(0, len(lengths) - 1))
    new_len = data.draw(st.integers(1, 64))
    r_rows, v_rows = rows(lengths, seed), rows(lengths, seed + 1)
    r2, v2 = list(r_rows), list(v_rows)
    r2[i] = torch.randn(new_len) * 100
    v2[i] = torch.randn(new_len) * 100
    before = (*gae(jag(r_rows), jag(v_rows), gamma=gamma, lam=lam), right_shift(jag(v_rows)))
    after = (*gae(jag(r2), jag(v2), gamma=gamma, lam=lam), right_shift(jag(v2)))
    for x, y in zip(before, after, strict=True):
        for j, (a, b) in enumerate(zip(x.unbind(), y.unbind(), strict=True)):
            if j != i:
                assert torch.equal(a, b), j


@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=16),
    prompt=st.integers(1, 8),
    pad=st.integers(0, 5),
    seed=seeds,
    gamma=unit,
    lam=unit,
)
def test_sequence_gae_matches_a_scalar_loop_per_row(
    lengths: list[int], prompt: int, pad: int, seed: int, gamma: float, lam: float
) -> None:
    """The reward lands on each row's last generated token; then GAE per row; padding (any width)
    stays 0 and changes nothing, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    b, w = len(lengths), max(lengths) + pad
    lengths_t = torch.tensor(lengths)
    starts = torch.clamp(torch.tensor([min(prompt, n - 1) for n in lengths]), min=1)
    pos = torch.arange(w)
    mask = ((pos >= starts[:, None]) & (pos < lengths_t[:, None])).long()
    values = torch.randn(b, w, generator=g) * (pos < lengths_t[:, None])
    rewards = torch.randn(b, generator=g)
    adv, ret = sequence_gae(values, mask, rewards, lengths_t, gamma=gamma, lam=lam)
    for i, n in enumerate(lengths):
        r = [0.0] * n
        r[n - 1] = float(rewards[i])  # the last generated token is the row's last token here
        want_a, want_r = ref_gae(r, values[i, :n].double().tolist(), gamma, lam)
        torch.testing.assert_close(adv[i, :n].double(), torch.tensor(want_a, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret[i, :n].double(), torch.tensor(want_r, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        assert not adv[i, n:].any() and not ret[i, n:].any()
    narrow = max(lengths)  # the same rows at another width, and each row alone: the same bits
    a2, r2 = sequence_gae(values[:, :narrow], mask[:, :narrow], rewards, lengths_t, gamma=gamma, lam=lam)
    assert torch.equal(a2, adv[:, :narrow]) and torch.equal(r2, ret[:, :narrow])
    a3, _ = sequence_gae(values[-1:], mask[-1:], rewards[-1:], lengths_t[-1:], gamma=gamma, lam=lam)
    assert torch.equal(a3[0], adv[-1])


def test_explained_variance_of_sums() -> None:
    returns = torch.tensor([[0.0, 1.0, 2.0, 4.0], [0.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    values = returns.clone()
    assert explained_variance(value_fit_sums(values, returns, mask)) == 1.0  # a perfect fit
    noisy = values + torch.tensor([[9.0, 0.5, -0.5, 0.0], [9.0, 0.0, 9.0, 9.0]])  # unmasked noise is ignored
    r = torch.tensor([1.0, 2.0, 4.0, 3.0])
    d = torch.tensor([-0.5, 0.5, 0.0, 0.0])
    want = 1 - d.var(unbiased=False) / r.var(unbiased=False)
    assert explained_variance(value_fit_sums(noisy, returns, mask)) == pytest.approx(float(want))
    halves = [value_fit_sums(noisy[i : i + 1], returns[i : i + 1], mask[i : i + 1]) for i in range(2)]
    summed = {k: halves[0][k] + halves[1][k] for k in halves[0]}  # shards add up
    assert explained_variance(summed) == pytest.approx(float(want))
    assert math.isnan(explained_variance(value_fit_sums(values, torch.ones_like(returns), mask)))


def test_gae_validation() -> None:
    a, b = jag([torch.ones(2), torch.ones(3)]), jag([torch.ones(3), torch.ones(2)])
    with pytest.raises(InvalidArgument, match="same row lengths"):
        gae(a, b, gamma=1.0, lam=1.0)
    with pytest.raises(InvalidArgument, match="gamma"):
        gae(a, a, gamma=1.5, lam=1.0)
    with pytest.raises(InvalidArgument, match="lam"):
        gae(a, a, gamma=1.0, lam=-0.1)
    with pytest.raises(InvalidArgument, match="jagged"):
        gae(torch.ones(2, 3), a, gamma=1.0, lam=1.0)


def test_gae_float64_and_known_values() -> None:
    r = jag([torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)])
    v = jag([torch.tensor([0.5, 0.25, 0.75], dtype=torch.float64)])
    adv, ret = gae(r, v, gamma=0.5, lam=1.0)
    assert adv.dtype == torch.float64
    # returns with lam=1 are discounted reward-to-go
    assert ret.unbind()[0].tolist() == [0.25, 0.5, 1.0]


# -- conventions ----------------------------------------------------------------------------------
@given(b=st.integers(0, 4), t=st.integers(1, 6), vocab=st.integers(1, 9), seed=seeds, temp=st.sampled_from([1.0, 0.7]))
def test_token_logprobs_matches_loop(b: int, t: int, vocab: int, seed: int, temp: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, vocab, generator=g, dtype=torch.float64).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    got = c.token_logprobs(logits, ids, temperature=temp)
    assert got.dtype == torch.float32 and got.shape == (b, t)
    want = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for pos in range(1, t):
            want[i, pos] = torch.log_softmax(logits[i, pos - 1].double() / temp, -1)[ids[i, pos]]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_token_logprobs_grad_and_validation() -> None:
    logits = torch.randn(2, 3, 5, requires_grad=True)
    c.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    assert logits.grad is not None and torch.equal(logits.grad[:, -1], torch.zeros(2, 5))
    with pytest.raises(InvalidArgument, match=r"\[B, T, V\]"):
        c.token_logprobs(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InvalidArgument, match="matching logits"):
        c.token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(InvalidArgument, match="long"):
        c.token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3))
    with pytest.raises(InvalidArgument, match="temperature"):
        c.token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


@given(b=st.integers(1, 3), t=st.integers(1, 7), chunk=st.integers(1, 8), seed=seeds, temp=st.sampled_from([1.0, 0.7]))
def test_chunked_token_logprobs_equal_the_whole_logits_path(b: int, t: int, chunk: int, seed: int, temp: float) -> None:
    """Chunked and unchunked log-probs agree to 1e-6 in fp32, and so do their gradients in the hidden
    states and in the output weight (to 1e-5 of the largest gradient: fp32 sums of another grouping;
    hypothesis found 1.1e-6 on a CPU)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, 6, generator=g, requires_grad=True)
    weight = torch.randn(13, 6, generator=g, requires_grad=True)
    ids = torch.randint(0, 13, (b, t), generator=g)
    upstream = torch.randn(b, t, generator=g)
    got = c.chunked_token_logprobs(hidden, weight, ids, temperature=temp, chunk_tokens=chunk)
    hg, wg = torch.autograd.grad((got * upstream).sum(), (hidden, weight)) if t > 1 else (None, None)
    want = c.token_logprobs(hidden @ weight.T, ids, temperature=temp)
    assert got.dtype == torch.float32 and got.shape == (b, t)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if t > 1:
        hw, ww = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
        for a, ref in ((hg, hw), (wg, ww)):  # fp32 sums in another grouping: a few ulps of the largest
            assert float((a - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max())), (a, ref)


def test_chunked_token_logprobs_keep_one_chunk_of_logits_at_most() -> None:
    """No tensor the autograd graph keeps holds a vocabulary-wide row for more token positions than
    one chunk (the whole path keeps all of them); the backward recomputes each chunk."""
    vocab, chunk = 1000, 4
    hidden = torch.randn(2, 17, 8, requires_grad=True)
    weight = torch.randn(vocab, 8, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 17))

    def widest_saved(fn: Any) -> int:
        sizes: list[int] = []

        def pack(x: torch.Tensor) -> torch.Tensor:
            if x.dim() and x.shape[-1] == vocab and x.data_ptr() != weight.data_ptr():
                sizes.append(x.numel() // vocab)  # token positions of [*, V] it holds
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn().sum().backward()
        return max(sizes, default=0)

    assert widest_saved(lambda: c.chunked_token_logprobs(hidden, weight, ids, chunk_tokens=chunk)) <= chunk
    assert widest_saved(lambda: c.token_logprobs(hidden @ weight.T, ids)) >= 2 * 16  # the rule can fail
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        c.chunked_token_logprobs(hidden, weight, ids, chunk_tokens=0)
    with pytest.raises(InvalidArgument, match=r"\[V, H=8\]"):
        c.chunked_token_logprobs(hidden, weight.T, ids)


def test_token_mask_and_names() -> None:
    want = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.equal(c.token_mask([2, 0], 3), want)
    assert torch.equal(c.token_mask(torch.tensor([2, 0]), 3), want)
    assert c.token_mask([], 4).shape == (0, 4)
    with pytest.raises(InvalidArgument, match="larger width"):
        c.token_mask([5], 3)
    assert c.row_key("u1", 0) == "u1_g0"
    assert c.REWARD not in c.TOKEN_FIELDS and c.LOSS_MASK in c.TOKEN_FIELDS
    assert (c.TAG_UID, c.TAG_SAMPLE_IDX, c.TAG_WEIGHT_VERSION) == ("uid", "sample_idx", "weight_version")
