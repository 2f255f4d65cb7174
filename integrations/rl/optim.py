"""The trainers' optimizer and learning-rate schedule.

:func:`build_optimizer` makes AdamW or plain SGD over a model's parameters (DTensors included; one
kernel per tensor, since a foreach over DTensors of different meshes is not supported).
:func:`lr_schedule` makes the rate a linear warm-up and then constant or a cosine decay; the split
step steps it once per finished step and reports the step's rate as ``lr``.

>>> import torch
>>> opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), lr=1.0)
>>> sched = lr_schedule(opt, warmup_steps=2, decay="cosine", total_steps=4)
>>> rates = []
>>> for _ in range(5):
...     rates.append(round(opt.param_groups[0]["lr"], 3))
...     opt.step()
...     sched.step()
>>> rates
[0.333, 0.667, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch

from dataplane import InvalidArgument
from dataplane.checks import check_int, check_number

__all__ = ["build_optimizer", "lr_schedule"]


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    name: Literal["adamw", "sgd"] = "adamw",
    lr: float = 1e-6,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.Optimizer:
    """AdamW (``betas``) or plain SGD (parameters move linearly in the gradient: what parity tests of a
    step compare best) over ``params``, without foreach kernels."""
    check_number("lr", lr, low=0)
    check_number("weight_decay", weight_decay, low=0)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, foreach=False)
    raise InvalidArgument(f"optimizer must be 'adamw' or 'sgd', got {name!r}")


def lr_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 0,
    decay: Literal["constant", "cosine"] = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A schedule of the optimizer's rate: step ``s`` (from 0) trains at ``lr * f(s)`` with

    * ``f(s) = (s + 1) / (warmup_steps + 1)`` during the warm-up (``s < warmup_steps``; the first
      step trains at a small rate, never at 0);
    * then ``1`` (``decay="constant"``), or a cosine from 1 at ``warmup_steps`` down to
      ``min_lr_ratio`` at ``total_steps`` and flat after (``decay="cosine"``, which needs ``total_steps``).

    Args:
        optimizer: its ``lr`` is the peak rate.
        warmup_steps: steps of linear warm-up, >= 0.
        decay: ``"constant"`` or ``"cosine"``.
        total_steps: the run's steps (cosine only), > ``warmup_steps``.
        min_lr_ratio: the cosine's floor as a share of the peak, in [0, 1].
    """
    warmup = check_int("warmup_steps", warmup_steps, low=0)
    floor = check_number("min_lr_ratio", min_lr_ratio, low=0, high=1)
    if decay not in ("constant", "cosine"):
        raise InvalidArgument(f"decay must be 'constant' or 'cosine', got {decay!r}")
    if decay == "cosine":
        if total_steps is None:
            raise InvalidArgument("a cosine schedule needs total_steps (the run's steps)")
        check_int("total_steps", total_steps, low=warmup + 1)
    total = total_steps or 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / (total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
