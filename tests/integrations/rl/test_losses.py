"""integrations.rl.losses against per-token python references; counts, masking, empty batches."""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from dataplane import InvalidArgument
from integrations.rl.losses import ClippedPolicyLoss, LossOutput, ValueLoss, clipped_policy_loss, value_loss


def make_batch(b: int, t: int, seed: int, *, per_seq_adv: bool = False, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A padded batch: random row lengths, prompt of random length, garbage (nan) in the padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    prompt = torch.minimum(torch.randint(0, t + 1, (b,), generator=g), lengths)
    pos = torch.arange(t)
    real = pos < lengths[:, None]
    mask = (real & (pos >= prompt[:, None])).long()

    def field(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g) * scale
        return x.masked_fill(~real, float("nan")) if len(shape) == 2 else x

    return {
        "loss_mask": mask,
        "prev_logprobs": field(b, t) - 1.0,
        "ref_logprobs": field(b, t) - 1.0,
        "advantages": torch.randn(b, generator=g) if per_seq_adv else field(b, t),
        "returns": field(b, t),
        "values": field(b, t),
        "outputs": field(b, t) - 1.0,
    }


def valid_positions(mask: torch.Tensor) -> list[list[int]]:
    return [[t for t in range(1, mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def reduce_ref(per_token: list[list[float]], loss_type: str) -> tuple[float, int]:
    """per_token: per row, the values at the valid positions."""
    if loss_type == "token":
        return sum(sum(r) for r in per_token), sum(len(r) for r in per_token)
    rows = [r for r in per_token if r]
    return sum(sum(r) / len(r) for r in rows), len(rows)


def ref_policy(batch: dict[str, torch.Tensor], lo: float, hi: float, kl_coef: float, est: str, lt: str) -> float:
    adv = batch["advantages"].double()
    per_token = []
    for i, ts in enumerate(valid_positions(batch["loss_mask"])):
        row = []
        for t in ts:
            lp, prev, ref = (float(batch[k][i, t]) for k in ("outputs", "prev_logprobs", "ref_logprobs"))
            a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            ratio = math.exp(lp - prev)
            pg = -min(ratio * a, min(max(ratio, 1 - lo), 1 + hi) * a)
            kl = math.exp(ref - lp) - (ref - lp) - 1 if est == "k3" else lp - ref
            row.append(pg + kl_coef * kl)
        per_token.append(row)
    return reduce_ref(per_token, lt)[0]


def ref_value(batch: dict[str, torch.Tensor], clip: float | None, lt: str) -> float:
    per_token = []
    for i, ts in enumerate(valid_positions(batch["loss_mask"])):
        row = []
        for t in ts:
            v, r, old = (float(batch[k][i, t]) for k in ("outputs", "returns", "values"))
            err = (v - r) ** 2
            if clip is not None:
                err = max(err, (old + min(max(v - old, -clip), clip) - r) ** 2)
            row.append(0.5 * err)
        per_token.append(row)
    return reduce_ref(per_token, lt)[0]


loss_types = st.sampled_from(["token", "sequence"])
shapes = st.tuples(st.integers(0, 6), st.integers(1, 12))


@given(
    shape=shapes,
    seed=st.integers(0, 2**31 - 1),
    per_seq=st.booleans(),
    lo=st.sampled_from([0.0, 0.1, 0.2, 10.0]),
    hi=st.sampled_from([None, 0.05, 0.3]),
    kl_coef=st.sampled_from([0.0, 0.3]),
    est=st.sampled_from(["k1", "k3"]),
    lt=loss_types,
)
def test_policy_loss_matches_reference(
    shape: tuple[int, int], seed: int, per_seq: bool, lo: float, hi: float | None, kl_coef: float, est: Any, lt: Any
) -> None:
    b, t = shape
    batch = make_batch(b, t, seed, per_seq_adv=per_seq)
    fn = ClippedPolicyLoss(clip_low=lo, clip_high=hi, kl_coef=kl_coef, kl_estimator=est, loss_type=lt)
    outputs = batch["outputs"].clone().requires_grad_()
    out = fn(outputs, {k: batch[k] for k in fn.fields})
    want = ref_policy(batch, lo, lo if hi is None else hi, kl_coef, est, lt)
    assert out.loss.dim() == 0 and out.count.dim() == 0
    assert math.isclose(out.loss.item(), want, rel_tol=1e-5, abs_tol=1e-5)
    tokens = sum(len(r) for r in valid_positions(batch["loss_mask"]))
    seqs = sum(1 for r in valid_positions(batch["loss_mask"]) if r)
    assert out.count.item() == (tokens if lt == "token" else seqs)
    assert out.metrics["num_valid_tokens"] == tokens and out.metrics["num_valid_sequences"] == seqs
    if kl_coef == 0:
        assert "kl" not in out.metrics
        assert math.isclose(out.metrics["pg_loss"], out.loss.item(), rel_tol=1e-6, abs_tol=1e-6)
    else:
        total = out.metrics["pg_loss"] + kl_coef * out.metrics["kl"]
        assert math.isclose(total, out.loss.item(), rel_tol=1e-5, abs_tol=1e-5)
    assert 0 <= out.metrics["clip_fraction"] <= out.count.item() + 1e-6
    # padding and prompt positions (and position 0) get exactly zero gradient, even with nan padding
    out.loss.backward()
    assert outputs.grad is not None and torch.isfinite(outputs.grad).all()
    invalid = batch["loss_mask"] == 0
    invalid[:, 0] = True
    assert torch.equal(outputs.grad[invalid], torch.zeros(int(invalid.sum())))


@given(shape=shapes, seed=st.integers(0, 2**31 - 1), clip=st.sampled_from([None, 0.0, 0.1, 5.0]), lt=loss_types)
def test_value_loss_matches_reference(shape: tuple[int, int], seed: int, clip: float | None, lt: Any) -> None:
    b, t = shape
    batch = make_batch(b, t, seed, scale=2.0)
    fn = ValueLoss(clip=clip, loss_type=lt)
    outputs = batch["outputs"].clone().requires_grad_()
    out = fn(outputs, {k: batch[k] for k in fn.fields})
    assert math.isclose(out.loss.item(), ref_value(batch, clip, lt), rel_tol=1e-5, abs_tol=1e-5)
    assert math.isclose(out.metrics["value_loss"], out.loss.item(), rel_tol=1e-6, abs_tol=1e-6)
    tokens = [r for r in valid_positions(batch["loss_mask"])]
    assert out.count.item() == (sum(map(len, tokens)) if lt == "token" else sum(1 for r in tokens if r))
    vals = [float(batch["outputs"][i, t]) for i, ts in enumerate(tokens) for t in ts]
    assert out.metrics["value_min"] == (min(vals) if vals else math.inf)
    assert out.metrics["value_max"] == (max(vals) if vals else -math.inf)
    out.loss.backward()
    invalid = batch["loss_mask"] == 0
    invalid[:, 0] = True
    assert outputs.grad is not None and torch.equal(outputs.grad[invalid], torch.zeros(int(invalid.sum())))


def test_counts_token_vs_sequence() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])  # position 0 never counts
    batch = {"loss_mask": mask, "returns": torch.zeros(4, 4)}
    v = torch.ones(4, 4)
    tok, seq = value_loss(v, batch), value_loss(v, batch, loss_type="sequence")
    assert (tok.count.item(), seq.count.item()) == (4.0, 2.0)
    # token: 0.5 per valid token; sequence: each valid row's mean (0.5) summed over rows
    assert (tok.loss.item(), seq.loss.item()) == (2.0, 1.0)
    assert tok.metrics["num_valid_sequences"] == seq.metrics["num_valid_sequences"] == 2.0
    assert tok.count.dtype == torch.float32
    assert batch["loss_mask"][0, 0] == 1  # the caller's mask is not modified


def test_clipping_active_and_inactive() -> None:
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    prev = torch.zeros(1, 5)
    lp = torch.tensor([[0.0, math.log(1.5), math.log(1.5), math.log(0.5), math.log(1.1)]], requires_grad=True)
    adv = torch.tensor([[0.0, 1.0, -1.0, -1.0, 1.0]])
    out = clipped_policy_loss(lp, {"loss_mask": mask, "prev_logprobs": prev, "advantages": adv})
    # token 1: ratio 1.5 > 1.2 with A > 0 -> clipped to 1.2; token 2: A < 0 -> unclipped 1.5;
    # token 3: ratio 0.5 < 0.8 with A < 0 -> clipped to 0.8; token 4: inside the range
    assert math.isclose(out.loss.item(), -1.2 + 1.5 + 0.8 - 1.1, rel_tol=1e-6, abs_tol=1e-6)
    assert out.metrics["clip_fraction"] == 2.0
    assert math.isclose(out.metrics["ratio_min"], 0.5, rel_tol=1e-6)
    assert math.isclose(out.metrics["ratio_max"], 1.5, rel_tol=1e-6)
    out.loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 1] == 0 and lp.grad[0, 3] == 0 and lp.grad[0, 2] != 0 and lp.grad[0, 4] != 0
    # asymmetric range: clip_high wide enough to leave token 1 alone
    wide = clipped_policy_loss(lp, {"loss_mask": mask, "prev_logprobs": prev, "advantages": adv}, clip_high=1.0)
    assert math.isclose(wide.loss.item(), -1.5 + 1.5 + 0.8 - 1.1, rel_tol=1e-6, abs_tol=1e-6)
    assert wide.metrics["clip_fraction"] == 1.0


def test_kl_estimators() -> None:
    lp = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0]])
    batch = {"loss_mask": torch.ones(1, 3), "prev_logprobs": lp, "advantages": torch.zeros(1), "ref_logprobs": ref}
    k1 = clipped_policy_loss(lp, batch, kl_coef=1.0, kl_estimator="k1")
    k3 = clipped_policy_loss(lp, batch, kl_coef=1.0, kl_estimator="k3")
    assert math.isclose(k1.metrics["kl"], 0.5 - 1.0, abs_tol=1e-6)
    want_k3 = sum(math.exp(d) - d - 1 for d in (-0.5, 1.0))
    assert math.isclose(k3.metrics["kl"], want_k3, rel_tol=1e-6)
    assert math.isclose(k3.loss.item(), want_k3, rel_tol=1e-6)


@pytest.mark.parametrize("lt", ["token", "sequence"])
@pytest.mark.parametrize("t", [0, 1, 5])
def test_empty_batch_backward(lt: Any, t: int) -> None:
    lp = torch.zeros(0, t, dtype=torch.bfloat16, requires_grad=True)
    e = torch.zeros(0, t)
    td = TensorDict(
        {"loss_mask": e.long(), "prev_logprobs": e, "ref_logprobs": e, "advantages": e, "returns": e, "values": e},
        batch_size=[0, t],
    )
    for out in (ClippedPolicyLoss(kl_coef=0.1, loss_type=lt)(lp, td), ValueLoss(clip=0.2, loss_type=lt)(lp, td)):
        assert out.loss.item() == 0.0 and out.count.item() == 0.0 and out.loss.dtype == torch.float32
        out.loss.backward()
        assert lp.grad is not None and lp.grad.shape == (0, t)
        mins = [v for k, v in out.metrics.items() if k.endswith("_min")]
        maxs = [v for k, v in out.metrics.items() if k.endswith("_max")]
        assert mins == [math.inf] and maxs == [-math.inf]


def test_all_masked_batch_is_connected() -> None:
    lp = torch.randn(2, 3, requires_grad=True)
    batch = {"loss_mask": torch.zeros(2, 3), "prev_logprobs": torch.zeros(2, 3), "advantages": torch.ones(2)}
    out = clipped_policy_loss(lp, batch, loss_type="sequence")
    assert out.loss.item() == 0.0 and out.count.item() == 0.0
    out.loss.backward()
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros(2, 3))


def test_bf16_outputs_compute_in_float32() -> None:
    batch = make_batch(3, 6, 0)
    batch["loss_mask"][:, 1] = 1
    lp = batch["outputs"].nan_to_num().to(torch.bfloat16).requires_grad_()
    out = clipped_policy_loss(lp, batch)
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert lp.grad is not None and lp.grad.dtype == torch.bfloat16


def test_callable_attributes() -> None:
    p = ClippedPolicyLoss()
    assert (p.input, p.fields, p.loss_type) == ("logprobs", ("loss_mask", "prev_logprobs", "advantages"), "token")
    assert ClippedPolicyLoss(kl_coef=0.1).fields[-1] == "ref_logprobs"
    v = ValueLoss(loss_type="sequence")
    assert (v.input, v.fields, v.loss_type) == ("values", ("loss_mask", "returns"), "sequence")
    assert ValueLoss(clip=0.5).fields == ("loss_mask", "returns", "values")
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(AttributeError):
        p.kl_coef = 1.0  # type: ignore[misc]
    out = LossOutput(loss=torch.tensor(1.0), count=torch.tensor(2.0), metrics={})
    assert out.count.item() == 2.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "mean"}, "loss_type"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"kl_estimator": "k2"}, "kl_estimator"),
    ],
)
def test_bad_config_raises_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        ClippedPolicyLoss(**kwargs)


def test_bad_shapes_raise() -> None:
    good = {"loss_mask": torch.ones(2, 3), "prev_logprobs": torch.zeros(2, 3), "advantages": torch.zeros(2)}
    lp = torch.zeros(2, 3)
    cases: list[tuple[Any, dict[str, torch.Tensor], str]] = [
        (torch.zeros(2, 3, 1), good, "outputs"),
        (torch.zeros(2, 3, dtype=torch.long), good, "outputs"),
        (lp, {**good, "loss_mask": torch.ones(2, 4)}, r"'loss_mask'.*\[2, 3\]"),
        (lp, {**good, "prev_logprobs": torch.zeros(3, 3)}, r"'prev_logprobs'.*\[2, 3\]"),
        (lp, {**good, "advantages": torch.zeros(3)}, r"'advantages'.*\[2\] or \[2, 3\]"),
        (lp, {k: v for k, v in good.items() if k != "prev_logprobs"}, "no field 'prev_logprobs'"),
    ]
    for outputs, batch, match in cases:
        with pytest.raises(InvalidArgument, match=match):
            clipped_policy_loss(outputs, batch)
    with pytest.raises(InvalidArgument, match="no field 'ref_logprobs'"):
        clipped_policy_loss(lp, good, kl_coef=0.1)
    with pytest.raises(InvalidArgument, match=r"'returns'.*\[2, 3\]"):
        value_loss(lp, {"loss_mask": torch.ones(2, 3), "returns": torch.zeros(2)})
    with pytest.raises(InvalidArgument, match="no field 'values'"):
        value_loss(lp, {"loss_mask": torch.ones(2, 3), "returns": torch.zeros(2, 3)}, clip=0.1)
    with pytest.raises(InvalidArgument, match="clip"):
        ValueLoss(clip=-1.0)
