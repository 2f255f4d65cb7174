"""RL training on the data plane: token-aligned conventions, advantage math, losses, the split train
step, and worker glue for FSDP2/DTensor trainers (:mod:`integrations.rl.workers`).

Synchronous GRPO over Ray actors lives in :mod:`integrations.rl.grpo` (driver),
:mod:`integrations.rl.policy` (the handle on a trainer group), :mod:`integrations.rl.trainer_actor`,
:mod:`integrations.rl.rollout_actor` and :mod:`integrations.rl.weight_sync`; a runnable example in
:mod:`integrations.rl.examples.grpo_tiny`; PPO in :mod:`integrations.rl.ppo`. Asynchronous GRPO with a
single controller: :mod:`integrations.rl.controller` over :mod:`integrations.rl.replay` and
:mod:`integrations.rl.staleness` (example :mod:`integrations.rl.examples.grpo_async_tiny`). What the
rollout actor samples with and scores: :mod:`integrations.rl.engines` (the engine protocol, the torch
and transformers engines), :mod:`integrations.rl.tasks` (text tasks, GSM8K, tokenizers) and
:mod:`integrations.rl.rewards` (example :mod:`integrations.rl.examples.grpo_text`). Only public
``dataplane`` names are used; Ray is never imported here, and those modules import it only where a
call needs it. See ``docs/rl.md`` (the guide) and ``docs/rl/api.md`` (the reference).

>>> import torch
>>> from integrations.rl import group_advantages
>>> [round(a, 4) for a in group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "a", "b", "b"]).tolist()]
[0.7071, -0.7071, 0.0, 0.0]
"""

from integrations.rl.advantages import gae, group_advantages, right_shift
from integrations.rl.conventions import row_key, shift_to_tokens, token_logprobs, token_mask
from integrations.rl.losses import ClippedPolicyLoss, LossOutput, LossType, ValueLoss
from integrations.rl.split_step import (
    LossFunction,
    PeerFailure,
    SplitTrainStepMixin,
    TrainStepError,
    aggregate_metrics,
    clip_grad_norm_,
    grad_norm,
)

__all__ = [
    "ClippedPolicyLoss",
    "LossFunction",
    "LossOutput",
    "LossType",
    "PeerFailure",
    "SplitTrainStepMixin",
    "TrainStepError",
    "ValueLoss",
    "aggregate_metrics",
    "clip_grad_norm_",
    "gae",
    "grad_norm",
    "group_advantages",
    "right_shift",
    "row_key",
    "shift_to_tokens",
    "token_logprobs",
    "token_mask",
]
