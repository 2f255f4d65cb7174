"""Advantage estimation on jagged batches: GRPO group baselines, the per-row right shift, and GAE.

Per-token inputs and outputs are jagged nested tensors (``torch.nested.nested_tensor(rows,
layout=torch.jagged)``): one row per sequence, each with its own length, no padding. Where the work is
vectorised over rows the rows are padded internally with zeros and the result is re-jagged, so no
padding ever reaches a result, and no value of one row ever reaches another row.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from dataplane import InvalidArgument
from dataplane.checks import check_number

__all__ = ["explained_variance", "gae", "group_advantages", "right_shift", "sequence_gae", "value_fit_sums"]

_JAGGED_HINT = "build one with torch.nested.nested_tensor(rows, layout=torch.jagged)"


def _check_jagged(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor) or not value.is_nested or value.layout != torch.jagged:
        raise InvalidArgument(f"{name} must be a jagged nested tensor [B, j, ...]; {_JAGGED_HINT}")
    return value


def _offsets(nt: Tensor) -> Tensor:
    offsets: Tensor = nt.offsets()  # type: ignore[attr-defined]  # a NestedTensor method
    return offsets


def _lengths(nt: Tensor) -> Tensor:
    lengths: Tensor | None = nt.lengths()  # type: ignore[attr-defined]  # set on non-contiguous views
    return (_offsets(nt).diff() if lengths is None else lengths).to(torch.int64)


def _flat(nt: Tensor) -> tuple[Tensor, Tensor]:
    """Row-major values (row after row, no gaps) and fresh offsets starting at 0."""
    lengths = _lengths(nt)
    if nt.is_contiguous():
        offsets = _offsets(nt)
        values = nt.values()[int(offsets[0]) : int(offsets[-1])]
    else:
        values = torch.cat(list(nt.unbind())) if lengths.numel() else nt.values()[:0]
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths.to(values.device), 0, out=offsets[1:])
    return values, offsets


def _jag(values: Tensor, offsets: Tensor) -> Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def group_advantages(
    rewards: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
) -> Tensor:
    """GRPO advantages: each reward minus its group's baseline, optionally scaled by the group's std.

    The baseline is the group's mean reward, or with ``leave_one_out`` the mean of the *other* members
    of the group (RLOO). With ``normalize_std`` the difference is divided by ``std + eps``, where std is
    the group's **unbiased** standard deviation (``torch.std``'s default, divisor ``n - 1``) over all its
    members. A group of one, and a group whose rewards are all equal, get advantage exactly 0.
    The arithmetic runs in float64; the result has ``rewards``' dtype.

    Args:
        rewards: ``[B]`` floating point rewards, one per row.
        group_ids: ``B`` hashable ids (e.g. the ``uid`` tag; a 1-D tensor counts by its values); rows with
            equal ids form a group. Groups may be interleaved in any order.
        normalize_std: divide by the group's std + ``eps``.
        eps: added to the std; must be >= 0.
        leave_one_out: baseline = mean of the group's other members instead of the group's mean.

    Returns:
        ``[B]`` advantages, in the order of ``rewards``.

    Example:
        >>> import torch
        >>> group_advantages(torch.tensor([1.0, 0.0, 5.0, 1.0]), ["a", "a", "b", "a"], normalize_std=False)
        tensor([ 0.3333, -0.6667,  0.0000,  0.3333])
    """
    if not isinstance(rewards, Tensor) or rewards.is_nested or rewards.dim() != 1 or not rewards.is_floating_point():
        got = type(rewards).__name__ if not isinstance(rewards, Tensor) else f"{rewards.dtype} {tuple(rewards.shape)}"
        raise InvalidArgument(f"rewards must be a 1-D floating point tensor [B], got {got}; use rewards.float()")
    if isinstance(group_ids, Tensor):
        group_ids = group_ids.tolist()
    if len(group_ids) != rewards.shape[0]:
        raise InvalidArgument(f"group_ids has {len(group_ids)} ids for {rewards.shape[0]} rewards; pass one id per row")
    check_number("eps", eps, low=0)
    index: dict[Hashable, int] = {}
    try:
        codes = [index.setdefault(g, len(index)) for g in group_ids]
    except TypeError as e:
        raise InvalidArgument(f"group_ids must be hashable (str, int, tuple, ...): {e}") from None
    g = torch.tensor(codes, dtype=torch.int64, device=rewards.device)
    r = rewards.detach().to(torch.float64)
    k = len(index)
    n = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros_like(n).index_add_(0, g, r) / n
    diff = r - mean[g]
    lo = torch.full_like(n, torch.inf).scatter_reduce_(0, g, r, "amin")
    hi = torch.full_like(n, -torch.inf).scatter_reduce_(0, g, r, "amax")
    degenerate = ((n < 2) | (lo == hi))[g]
    ni = n[g].clamp(min=2)
    adv = diff * ni / (ni - 1) if leave_one_out else diff
    if normalize_std:
        std = (torch.zeros_like(n).index_add_(0, g, diff * diff) / (n - 1).clamp(min=1)).sqrt()
        adv = adv / (std[g] + eps)
    adv = torch.where(degenerate, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype)


def right_shift(values: Tensor) -> Tensor:
    """Shift every jagged row right by one: ``out[0] = 0``, ``out[t] = values[t - 1]``, never across rows.

    This turns a model's next-token outputs (position ``t`` predicts token ``t + 1``) into token-aligned
    fields (``out[t]`` belongs to token ``t``). For a padded ``[B, T]`` tensor use
    :func:`integrations.rl.conventions.shift_to_tokens`.

    Args:
        values: jagged nested tensor ``[B, j, ...]``.

    Returns:
        A jagged nested tensor with the same row lengths and dtype.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])], layout=torch.jagged)
        >>> [row.tolist() for row in right_shift(nt).unbind()]
        [[0.0, 1.0], [0.0, 3.0, 4.0]]
    """
    _check_jagged("values", values)
    flat, offsets = _flat(values)
    out = flat.roll(1, 0) if flat.shape[0] else flat.clone()
    starts = offsets[:-1][offsets[:-1] < flat.shape[0]]
    out[starts] = 0
    return _jag(out, offsets)


def _padded(nt: Tensor, lengths: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    flat, _ = _flat(nt)
    out = torch.zeros(lengths.numel(), width, dtype=dtype, device=flat.device)
    out[torch.arange(width, device=flat.device) < lengths.to(flat.device)[:, None]] = flat.to(dtype)
    return out


def gae(token_rewards: Tensor, values: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation per jagged row; the value after a row's last token is 0.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns = A + V``. ``values`` are token-aligned (``values[t] = V(s_t)``, see
    :mod:`integrations.rl.conventions`). Rows are padded with zeros to ``[B, Tmax]`` internally and the
    time loop runs in reverse over all rows at once; the zero padding is exactly "value after the end
    is 0" and produces exact zeros, so a row's result does not depend on the other rows.

    Args:
        token_rewards: jagged ``[B, j]`` per-token rewards (e.g. the sequence reward on the last token
            minus a KL penalty).
        values: jagged ``[B, j]`` token-aligned values; same row lengths as ``token_rewards``.
        gamma: discount, in ``[0, 1]``.
        lam: GAE lambda, in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``: jagged ``[B, j]`` tensors with the input row lengths, in the promoted
        dtype of the inputs (at least float32).

    Example:
        >>> import torch
        >>> r = torch.nested.nested_tensor([torch.tensor([0.0, 1.0])], layout=torch.jagged)
        >>> v = torch.nested.nested_tensor([torch.tensor([0.5, 0.5])], layout=torch.jagged)
        >>> adv, ret = gae(r, v, gamma=1.0, lam=1.0)
        >>> adv.unbind()[0].tolist(), ret.unbind()[0].tolist()
        ([0.5, 0.5], [1.0, 1.0])
    """
    _check_jagged("token_rewards", token_rewards)
    _check_jagged("values", values)
    if token_rewards.dim() != 2 or values.dim() != 2:
        raise InvalidArgument(
            f"token_rewards and values must be jagged [B, j] with one scalar per token, got "
            f"{token_rewards.dim()}-D and {values.dim()}-D"
        )
    for name, x in (("gamma", gamma), ("lam", lam)):
        check_number(name, x, low=0, high=1)
    lengths = _lengths(token_rewards)
    v_lengths = _lengths(values)
    if lengths.shape != v_lengths.shape or not torch.equal(lengths, v_lengths):
        raise InvalidArgument(
            f"token_rewards and values must have the same row lengths, got {lengths.tolist()} and "
            f"{v_lengths.tolist()}; compute both for the same rows"
        )
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    width = int(lengths.max()) if lengths.numel() else 0
    r = _padded(token_rewards, lengths, width, dtype)
    v = _padded(values, lengths, width, dtype)
    adv = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=dtype, device=r.device)
    next_v = torch.zeros_like(running)
    for t in range(width - 1, -1, -1):
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = delta + (gamma * lam) * running
        adv[:, t] = running
        next_v = v[:, t]
    mask = torch.arange(width, device=r.device) < lengths.to(r.device)[:, None]
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=r.device)
    torch.cumsum(lengths.to(r.device), 0, out=offsets[1:])
    return _jag(adv[mask], offsets), _jag((adv + v)[mask], offsets)


def _rows(padded: Tensor, lengths: Tensor) -> Tensor:
    return torch.nested.nested_tensor(
        [padded[i, : int(n)] for i, n in enumerate(lengths.tolist())], layout=torch.jagged
    )


def sequence_gae(
    values: Tensor, loss_mask: Tensor, rewards: Tensor, lengths: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """PPO advantages for sequence rewards on right-padded rows: the reward on each row's last
    generated token (the last with ``loss_mask != 0``), then :func:`gae` per row.

    Args:
        values: ``[B, W]`` token-aligned values ``V(s_t)`` (zeros past each row).
        loss_mask: ``[B, W]``, non-zero on generated tokens.
        rewards: ``[B]`` one reward per row (a row with no generated token gets none).
        lengths: ``[B]`` row lengths (``<= W``).
        gamma, lam: as for :func:`gae`.

    Returns:
        ``(advantages, returns)``, ``[B, W]`` float32 (at least), zeros past each row's length. A row's
        result depends on that row alone, bit for bit, whatever else is in the batch.

    Example:
        >>> import torch
        >>> adv, ret = sequence_gae(torch.tensor([[0.0, 0.5, 0.5, 0.0]]), torch.tensor([[0, 1, 1, 0]]),
        ...                         torch.tensor([1.0]), torch.tensor([3]), gamma=1.0, lam=1.0)
        >>> adv.tolist(), ret.tolist()
        ([[1.0, 0.5, 0.5, 0.0]], [[1.0, 1.0, 1.0, 0.0]])
    """
    b, w = values.shape
    if loss_mask.shape != (b, w) or rewards.shape != (b,) or lengths.shape != (b,):
        raise InvalidArgument(
            f"need values and loss_mask [B, W], rewards and lengths [B]; got {tuple(values.shape)}, "
            f"{tuple(loss_mask.shape)}, {tuple(rewards.shape)}, {tuple(lengths.shape)}"
        )
    lengths = lengths.to(torch.int64)
    if b and (int(lengths.min()) < 1 or int(lengths.max()) > w):
        raise InvalidArgument(f"lengths must lie in [1, W={w}], got {lengths.tolist()}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    generated = (loss_mask != 0) & (torch.arange(w) < lengths[:, None])
    last = torch.where(generated, torch.arange(w), -1).max(dim=1).values if w else torch.full((b,), -1)
    token_rewards = torch.zeros(b, w, dtype=dtype)
    has = last >= 0
    token_rewards[has, last[has]] = rewards[has].to(dtype)
    if b == 0:
        return torch.zeros(0, w, dtype=dtype), torch.zeros(0, w, dtype=dtype)
    adv, ret = gae(_rows(token_rewards, lengths), _rows(values.to(dtype), lengths), gamma=gamma, lam=lam)
    mask = torch.arange(w) < lengths[:, None]
    out_adv, out_ret = torch.zeros(b, w, dtype=dtype), torch.zeros(b, w, dtype=dtype)
    out_adv[mask] = adv.values()
    out_ret[mask] = ret.values()
    return out_adv, out_ret


def value_fit_sums(values: Tensor, returns: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """Sums over the trained tokens (``loss_mask != 0``, position 0 excluded) from which
    :func:`explained_variance` follows; add the sums of several shards before calling it."""
    mask = loss_mask != 0
    mask[:, :1] = False
    r = returns[mask].double()
    d = r - values[mask].double()
    return {
        "count": float(mask.sum()),
        "returns": float(r.sum()),
        "returns_sq": float((r * r).sum()),
        "residual": float(d.sum()),
        "residual_sq": float((d * d).sum()),
    }


def explained_variance(sums: dict[str, float]) -> float:
    """``1 - Var(returns - values) / Var(returns)`` from :func:`value_fit_sums` (NaN without spread).

    >>> import torch
    >>> m = torch.tensor([[0, 1, 1, 1]])
    >>> round(explained_variance(value_fit_sums(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), torch.tensor([[0.0, 1.0, 2.0, 4.0]]), m)), 4)
    0.8571
    """
    n = sums["count"]
    if n < 1:
        return float("nan")
    var_r = sums["returns_sq"] / n - (sums["returns"] / n) ** 2
    var_d = sums["residual_sq"] / n - (sums["residual"] / n) ** 2
    return float("nan") if var_r <= 0 else 1.0 - var_d / var_r
