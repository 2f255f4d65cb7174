"""Policy and value losses that return an unnormalised sum and the count to divide it by.

A split train step runs many microbatches (on many DP ranks) before it knows the global number of
valid tokens or sequences, so a loss here never divides by its local count. It returns a
:class:`LossOutput`: ``loss`` is the sum over valid elements, ``count`` how many elements that sum
covers, and the step divides the accumulated gradients once by the global count ``N``.

* ``loss_type="token"``: the sum over valid tokens; ``count`` = valid tokens.
* ``loss_type="sequence"``: each row with at least one valid token contributes the mean over its
  valid tokens; ``count`` = such rows.

Valid tokens are those with ``loss_mask != 0``, except position 0, which nothing predicts. Inputs are
padded ``[B, T]`` token-aligned tensors (:mod:`integrations.rl.conventions`); padding values never
reach the loss or its gradient. Arithmetic runs in float32 (float64 inputs stay float64).

Metric names follow the split step's aggregation rule: ``*_min`` -> min, ``*_max`` -> max,
``num_*`` -> plain sum, anything else -> a sum normalised exactly like the loss, so ``sum / N`` is
a mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeAlias

import torch
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import InvalidArgument
from dataplane.checks import check_number
from integrations.rl.conventions import (
    ADVANTAGES,
    GEN_LOGPROBS,
    LOSS_MASK,
    PREV_LOGPROBS,
    REF_LOGPROBS,
    RETURNS,
    VALUES,
)

__all__ = ["ClippedPolicyLoss", "LossOutput", "LossType", "ValueLoss", "clipped_policy_loss", "value_loss"]

LossType = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k3"]
Batch: TypeAlias = "TensorDictBase | Mapping[str, Tensor]"


@dataclass(frozen=True, slots=True)
class LossOutput:
    """What a loss callable returns.

    Attributes:
        loss: 0-dim, the **unnormalised** sum over valid elements, connected to the outputs' graph.
        count: 0-dim float32, the local number of elements ``loss`` sums over (valid tokens for
            ``"token"``, rows with at least one valid token for ``"sequence"``).
        metrics: python floats named by the aggregation rule in the module docstring.
    """

    loss: Tensor
    count: Tensor
    metrics: dict[str, float]


# -- shared plumbing ------------------------------------------------------------------------------
def _check_loss_type(loss_type: object) -> None:
    if loss_type not in ("token", "sequence"):
        raise InvalidArgument(f"loss_type must be 'token' or 'sequence', got {loss_type!r}")


def _check_outputs(outputs: object, what: str) -> tuple[int, int]:
    if not isinstance(outputs, Tensor) or outputs.is_nested or outputs.dim() != 2 or not outputs.is_floating_point():
        got = f"{outputs.dtype} {tuple(outputs.shape)}" if isinstance(outputs, Tensor) else type(outputs).__name__
        raise InvalidArgument(
            f"outputs must be the token-aligned {what} as a padded floating point tensor [B, T], got {got}"
        )
    return outputs.shape[0], outputs.shape[1]


def _field(batch: Batch, name: str, shapes: tuple[tuple[int, ...], ...], reader: str) -> Tensor:
    """``batch[name]``, checked to have one of ``shapes``."""
    try:
        value = batch[name]
    except KeyError:
        raise InvalidArgument(
            f"batch has no field {name!r}, which {reader} reads; fetch it with the batch (see the loss' fields)"
        ) from None
    if not isinstance(value, Tensor) or value.is_nested or tuple(value.shape) not in shapes:
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        want = " or ".join(str(list(s)) for s in shapes)
        raise InvalidArgument(f"batch[{name!r}] must have shape {want} (padded [B, T] like the outputs), got {got}")
    return value


def _valid_mask(batch: Batch, b: int, t: int, reader: str) -> Tensor:
    mask = _field(batch, LOSS_MASK, ((b, t),), reader) != 0
    if t:
        mask[:, 0] = False  # nothing predicts token 0
    return mask


def _clean(x: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype`` with invalid positions set to 0, so padding (even inf/nan) can't reach a gradient."""
    return torch.where(mask, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))


class _Reducer:
    """Token- or sequence-level sums of per-token tensors over the valid mask."""

    def __init__(self, mask: Tensor, loss_type: LossType, dtype: torch.dtype) -> None:
        self.mask = mask
        self.loss_type = loss_type
        self.dtype = dtype
        per_row = mask.sum(1)
        self.rows = per_row > 0
        self.tokens = int(per_row.sum())
        self.sequences = int(self.rows.sum())
        self.row_weight = self.rows.to(dtype) / per_row.clamp(min=1).to(dtype)

    @property
    def count(self) -> Tensor:
        n = self.tokens if self.loss_type == "token" else self.sequences
        return torch.tensor(float(n), dtype=torch.float32, device=self.mask.device)

    def sum(self, per_token: Tensor) -> Tensor:
        masked = torch.where(self.mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
        if self.loss_type == "token":
            return masked.sum()
        return (masked.sum(1) * self.row_weight).sum()

    def extremes(self, x: Tensor) -> tuple[float, float]:
        if not self.tokens:
            return float("inf"), float("-inf")
        valid = x.detach()[self.mask]
        return float(valid.min()), float(valid.max())

    def counts(self) -> dict[str, float]:
        return {"num_valid_tokens": float(self.tokens), "num_valid_sequences": float(self.sequences)}


def _compute_dtype(outputs: Tensor) -> torch.dtype:
    return torch.promote_types(outputs.dtype, torch.float32)


# -- policy loss ----------------------------------------------------------------------------------
def clipped_policy_loss(
    logprobs: Tensor,
    batch: Batch,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    loss_type: LossType = "token",
    sampler_check: bool = False,
) -> LossOutput:
    """PPO/GRPO clipped surrogate plus an optional KL penalty to a reference policy.

    Per valid token, with ``ratio = exp(logprobs - prev_logprobs)`` and advantage ``A``:
    ``pg = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)``; the KL term is
    ``k3 = exp(ref - lp) - (ref - lp) - 1`` or ``k1 = lp - ref``; ``per_token = pg + kl_coef * kl``.

    Args:
        logprobs: ``[B, T]`` current token-aligned log-probabilities (the model's output).
        batch: reads ``loss_mask`` ``[B, T]``, ``prev_logprobs`` ``[B, T]``, ``advantages`` ``[B]``
            (per sequence, broadcast over tokens) or ``[B, T]``, and ``ref_logprobs`` ``[B, T]`` when
            ``kl_coef > 0``.
        clip_low: lower clip range (ratio >= 1 - clip_low).
        clip_high: upper clip range; ``None`` means ``clip_low``.
        kl_coef: weight of the KL penalty; 0 disables it (``ref_logprobs`` is then not read).
        kl_estimator: ``"k3"`` (non-negative, low variance) or ``"k1"``.
        loss_type: ``"token"`` or ``"sequence"`` (see the module docstring).
        sampler_check: also read ``gen_logprobs`` (the rollout engine's log-probs of the same tokens)
            and report how far they are from ``prev_logprobs`` (the trainer's, with the weights the
            engine sampled with): ~0 when weight sync and the two models agree; a spike is a broken
            sync (or, in an asynchronous run, rows sampled by older weights).

    Returns:
        A :class:`LossOutput`; metrics ``pg_loss``, ``kl`` (when ``kl_coef > 0``), ``clip_fraction`` (the
        share of valid tokens whose gradient is clipped away), ``ratio_min``, ``ratio_max``,
        ``num_valid_tokens``, ``num_valid_sequences``; with ``sampler_check``, ``sampler_logprob_diff``
        (the mean ``|gen_logprobs - prev_logprobs|``) and ``sampler_logprob_diff_max``.

    Example:
        >>> import torch
        >>> lp = torch.zeros(1, 3, requires_grad=True)
        >>> batch = {"loss_mask": torch.tensor([[0, 1, 1]]), "prev_logprobs": torch.zeros(1, 3),
        ...          "advantages": torch.tensor([2.0])}
        >>> out = clipped_policy_loss(lp, batch)
        >>> out.loss.item(), out.count.item(), out.metrics["clip_fraction"]
        (-4.0, 2.0, 0.0)
    """
    reader = "clipped_policy_loss"
    b, t = _check_outputs(logprobs, "log-probabilities")
    _check_loss_type(loss_type)
    high = clip_low if clip_high is None else clip_high
    check_number("clip_low", clip_low, low=0)
    check_number("clip_high", clip_high, low=0, allow_none=True)
    check_number("kl_coef", kl_coef, low=0)
    if kl_estimator not in ("k1", "k3"):
        raise InvalidArgument(f"kl_estimator must be 'k1' or 'k3', got {kl_estimator!r}")
    dtype = _compute_dtype(logprobs)
    mask = _valid_mask(batch, b, t, reader)
    prev = _clean(_field(batch, PREV_LOGPROBS, ((b, t),), reader), mask, dtype)
    adv = _field(batch, ADVANTAGES, ((b,), (b, t)), reader)
    adv = _clean(adv[:, None].expand(b, t) if adv.dim() == 1 else adv, mask, dtype)
    lp = _clean(logprobs, mask, dtype)
    red = _Reducer(mask, loss_type, dtype)

    ratio = torch.exp(lp - prev)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + high) * adv)
    per_token = pg
    clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    metrics = {"pg_loss": float(red.sum(pg.detach())), "clip_fraction": float(red.sum(clipped.to(dtype)))}
    if kl_coef > 0:
        ref = _clean(_field(batch, REF_LOGPROBS, ((b, t),), reader), mask, dtype)
        kl = torch.exp(ref - lp) - (ref - lp) - 1 if kl_estimator == "k3" else lp - ref
        per_token = pg + kl_coef * kl
        metrics["kl"] = float(red.sum(kl.detach()))
    metrics["ratio_min"], metrics["ratio_max"] = red.extremes(ratio)
    if sampler_check:
        gen = _clean(_field(batch, GEN_LOGPROBS, ((b, t),), reader), mask, dtype)
        gap = (gen - prev).abs()
        metrics["sampler_logprob_diff"] = float(red.sum(gap))
        metrics["sampler_logprob_diff_max"] = red.extremes(gap)[1] if red.tokens else 0.0
    metrics.update(red.counts())
    return LossOutput(loss=red.sum(per_token), count=red.count, metrics=metrics)


@dataclass(frozen=True, slots=True)
class ClippedPolicyLoss:
    """:func:`clipped_policy_loss` as a configured loss callable for a train step.

    Example:
        >>> loss_fn = ClippedPolicyLoss(kl_coef=0.1, loss_type="sequence")
        >>> loss_fn.input, loss_fn.fields
        ('logprobs', ('loss_mask', 'prev_logprobs', 'advantages', 'ref_logprobs'))
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    loss_type: LossType = "token"
    sampler_check: bool = False
    input: ClassVar[Literal["logprobs"]] = "logprobs"

    def __post_init__(self) -> None:
        # fail at construction, not at the first microbatch
        clipped_policy_loss(
            torch.zeros(0, 1),
            {LOSS_MASK: torch.zeros(0, 1), PREV_LOGPROBS: torch.zeros(0, 1), ADVANTAGES: torch.zeros(0)},
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            kl_coef=0.0,
            kl_estimator=self.kl_estimator,
            loss_type=self.loss_type,
        )
        check_number("kl_coef", self.kl_coef, low=0)

    @property
    def fields(self) -> tuple[str, ...]:
        """The batch fields the loss reads (besides the model's output)."""
        base: tuple[str, ...] = (LOSS_MASK, PREV_LOGPROBS, ADVANTAGES)
        base = (*base, REF_LOGPROBS) if self.kl_coef > 0 else base
        return (*base, GEN_LOGPROBS) if self.sampler_check else base

    def __call__(self, outputs: Tensor, batch: Batch) -> LossOutput:
        return clipped_policy_loss(
            outputs,
            batch,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            loss_type=self.loss_type,
            sampler_check=self.sampler_check,
        )


# -- value loss -----------------------------------------------------------------------------------
def value_loss(values: Tensor, batch: Batch, *, clip: float | None = None, loss_type: LossType = "token") -> LossOutput:
    """Squared error of token-aligned values against ``returns``, optionally PPO value-clipped.

    ``per_token = 0.5 * (v - R)^2``; with ``clip``:
    ``0.5 * max((v - R)^2, (old + clamp(v - old, -clip, clip) - R)^2)`` where ``old`` is the batch's
    ``values`` (the values the returns were computed with).

    Args:
        values: ``[B, T]`` current token-aligned values (the model's output).
        batch: reads ``loss_mask`` and ``returns`` ``[B, T]``, and ``values`` ``[B, T]`` when ``clip``
            is set.
        clip: value clip range (>= 0), or ``None`` for no clipping.
        loss_type: ``"token"`` or ``"sequence"`` (see the module docstring).

    Returns:
        A :class:`LossOutput`; metrics ``value_loss``, ``value_min``, ``value_max`` (of ``values`` over
        valid tokens), ``num_valid_tokens``, ``num_valid_sequences``.

    Example:
        >>> import torch
        >>> v = torch.tensor([[0.0, 1.0, 3.0]], requires_grad=True)
        >>> batch = {"loss_mask": torch.tensor([[0, 1, 1]]), "returns": torch.tensor([[9.0, 2.0, 2.0]])}
        >>> out = value_loss(v, batch)
        >>> out.loss.item(), out.count.item(), out.metrics["value_max"]
        (1.0, 2.0, 3.0)
    """
    reader = "value_loss"
    b, t = _check_outputs(values, "values")
    _check_loss_type(loss_type)
    check_number("clip", clip, low=0, allow_none=True)
    dtype = _compute_dtype(values)
    mask = _valid_mask(batch, b, t, reader)
    returns = _clean(_field(batch, RETURNS, ((b, t),), reader), mask, dtype)
    v = _clean(values, mask, dtype)
    red = _Reducer(mask, loss_type, dtype)
    err = (v - returns) ** 2
    if clip is not None:
        old = _clean(_field(batch, VALUES, ((b, t),), reader), mask, dtype)
        err = torch.maximum(err, (old + (v - old).clamp(-clip, clip) - returns) ** 2)
    per_token = 0.5 * err
    metrics = {"value_loss": float(red.sum(per_token.detach()))}
    metrics["value_min"], metrics["value_max"] = red.extremes(v)
    metrics.update(red.counts())
    return LossOutput(loss=red.sum(per_token), count=red.count, metrics=metrics)


@dataclass(frozen=True, slots=True)
class ValueLoss:
    """:func:`value_loss` as a configured loss callable for a train step.

    Example:
        >>> ValueLoss(clip=0.2).fields
        ('loss_mask', 'returns', 'values')
    """

    clip: float | None = None
    loss_type: LossType = "token"
    input: ClassVar[Literal["values"]] = "values"

    def __post_init__(self) -> None:
        # fail at construction, not at the first microbatch
        empty = torch.zeros(0, 1)
        value_loss(empty, {LOSS_MASK: empty, RETURNS: empty, VALUES: empty}, clip=self.clip, loss_type=self.loss_type)

    @property
    def fields(self) -> tuple[str, ...]:
        """The batch fields the loss reads (besides the model's output)."""
        return (LOSS_MASK, RETURNS, VALUES) if self.clip is not None else (LOSS_MASK, RETURNS)

    def __call__(self, outputs: Tensor, batch: Batch) -> LossOutput:
        return value_loss(outputs, batch, clip=self.clip, loss_type=self.loss_type)
