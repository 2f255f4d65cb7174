"""Synchronous PPO with a value model over the data plane.

One :meth:`PPO.step` (the envelope is :class:`~integrations.rl.sync_loop.SyncLoop`'s):

1. the rollout actor samples, scores and writes the rows; the driver gets the meta and rewards;
2. the value model writes ``values`` (token-aligned: ``values[t] = V(s_t)``, the head's output at
   ``t - 1`` shifted right, position 0 = 0), the policy ``prev_logprobs``, the reference model
   ``ref_logprobs`` when ``kl_coef > 0``;
3. **the advantage stage runs on the trainers**: it reads per-token ``values`` (bulk), so each DP
   shard's leader places the row's reward on its last generated token, runs GAE
   (:func:`~integrations.rl.advantages.sequence_gae`) and writes ``advantages`` and ``returns`` back;
   the driver gets only the sums for the explained variance;
4. ``epochs`` passes over ``minibatches`` minibatches (rows reshuffled each epoch with a seed from
   the step, the same on every transport): per minibatch one policy step
   (:class:`~integrations.rl.losses.ClippedPolicyLoss`) and one value step
   (:class:`~integrations.rl.losses.ValueLoss` on the same right-shifted values), each split
   (``begin``, a ``train_chunk`` per chunk, ``finish``) or monolithic;
5. the partition is cleared and the weights go to the rollout actor.

The policy and the value model are **two models** (``"policy"`` and ``"value"`` workers on the same
ranks): separate optimizers and learning rates, no shared trunk whose two losses need weighting,
and the value head's shift cannot touch the policy's logits.

Without a data plane (``client=None``) the driver runs the advantage stage itself on the tensors
it holds: the same function on the same rows, so the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import DataPlaneClient, InvalidArgument, KVBatchMeta
from dataplane.checks import check_int, check_number
from integrations.rl.advantages import explained_variance, sequence_gae, value_fit_sums
from integrations.rl.conventions import (
    ADVANTAGES,
    LOSS_MASK,
    PREV_LOGPROBS,
    REF_LOGPROBS,
    RETURNS,
    REWARD,
    VALUES,
)
from integrations.rl.losses import ClippedPolicyLoss, LossType, ValueLoss
from integrations.rl.policy import ChunkResult, Policy
from integrations.rl.sync_loop import StepRecord, SyncLoop, even_parts
from integrations.rl.weight_sync import WeightSync

__all__ = ["PPO", "PPOConfig", "minibatch_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PPOConfig:
    """PPO's settings (sampling sizes live on the rollout actor).

    Attributes:
        clip: policy ratio clip range.
        value_clip: value clip range around the rollout's values (None: plain squared error).
        kl_coef: weight of the k3 KL penalty to the reference model in the policy loss (0: no
            reference pass).
        gamma, lam: GAE discount and lambda.
        epochs, minibatches: passes over the batch, and optimizer steps per pass (per model).
        loss_type: ``"token"`` or ``"sequence"`` normalisation of both losses.
        train_step: ``"split"`` (begin, a ``train_chunk`` per chunk, finish) or ``"monolithic"``.
        train_chunks: chunks per minibatch for the split step.
        seed: seeds each epoch's minibatch shuffle (with the step and epoch).
        partition_prefix, timeout_s: see :class:`~integrations.rl.sync_loop.SyncLoop`.
        sampler_check: report how far the rollout engine's log-probs are from the trainer's
            (:class:`~integrations.rl.grpo.GRPOConfig`).
    """

    clip: float = 0.2
    value_clip: float | None = None
    kl_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    epochs: int = 2
    minibatches: int = 2
    loss_type: LossType = "token"
    train_step: Literal["split", "monolithic"] = "split"
    train_chunks: int = 2
    seed: int = 0
    partition_prefix: str = "ppo"
    timeout_s: float = 300.0
    sampler_check: bool = True

    def __post_init__(self) -> None:
        if self.train_step not in ("split", "monolithic"):
            raise InvalidArgument(f"train_step must be 'split' or 'monolithic', got {self.train_step!r}")
        for name in ("epochs", "minibatches", "train_chunks"):
            check_int(name, getattr(self, name), low=1)
        for name in ("gamma", "lam"):
            check_number(name, getattr(self, name), low=0, high=1)
        self.policy_loss()
        self.value_loss()

    def policy_loss(self) -> ClippedPolicyLoss:
        return ClippedPolicyLoss(
            clip_low=self.clip, kl_coef=self.kl_coef, loss_type=self.loss_type, sampler_check=self.sampler_check
        )

    def value_loss(self) -> ValueLoss:
        return ValueLoss(clip=self.value_clip, loss_type=self.loss_type)


def group_rewards(rewards: Tensor, meta: KVBatchMeta) -> dict[str, list[float]]:
    """The rows' rewards by their ``uid`` tag (one group per prompt), in row order.

    >>> import torch
    >>> m = KVBatchMeta(partition_id="p", keys=["a", "b"], tags=[{"uid": "u"}, {"uid": "u"}])
    >>> group_rewards(torch.tensor([1.0, 0.0]), m)
    {'u': [1.0, 0.0]}
    """
    out: dict[str, list[float]] = {}
    for tag, r in zip(meta.tags or [{}] * meta.size, rewards.tolist(), strict=True):
        out.setdefault(str(tag.get("uid", "")), []).append(float(r))
    return out


def minibatch_rows(rows: int, minibatches: int, *, seed: int) -> list[list[int]]:
    """``rows`` positions shuffled with ``seed`` and cut into ``minibatches`` parts (sizes differ by at
    most one; each part in ascending order, so a part keeps the batch's row order).

    >>> minibatch_rows(5, 2, seed=0)
    [[0, 1, 4], [2, 3]]
    """
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return [sorted(order[a:b]) for a, b in even_parts(rows, minibatches)]


class PPO(SyncLoop):
    """Synchronous PPO; see the module docstring.

    Args:
        policy: the trainer group, with ``"policy"`` and ``"value"`` workers (and ``"reference"``
            when ``config.kl_coef > 0``).
        rollout, client, weight_sync: see :class:`~integrations.rl.sync_loop.SyncLoop`.
        config: :class:`PPOConfig`.
    """

    def __init__(
        self,
        policy: Policy,
        rollout: Any,
        config: PPOConfig | None = None,
        *,
        client: DataPlaneClient | None = None,
        weight_sync: WeightSync | None = None,
    ) -> None:
        self.config: PPOConfig = config or PPOConfig()
        super().__init__(policy, rollout, self.config, client=client, weight_sync=weight_sync)

    def learn(
        self, step: int, partition: str, meta: KVBatchMeta, rewards: Tensor, data: TensorDictBase | None
    ) -> StepRecord:
        cfg = self.config
        record = StepRecord(
            step=step,
            partition_id=partition,
            reward_mean=float(rewards.double().mean()),
            rows_trained=meta.size,
            version=self.policy.version,
            group_rewards=group_rewards(rewards, meta),
        )
        if meta.size == 0:
            return record
        meta, data = self.forward("values", meta, data, VALUES, "value")
        meta, data = self.forward("logprobs", meta, data, PREV_LOGPROBS, "policy")
        if cfg.kl_coef > 0:
            meta, data = self.forward("logprobs", meta, data, REF_LOGPROBS, "reference")
        if data is None:
            meta, sums = self.policy.sequence_gae(meta, gamma=cfg.gamma, lam=cfg.lam)
        else:
            lengths = torch.tensor(meta.sequence_lengths or (), dtype=torch.int64)
            adv, ret = sequence_gae(data[VALUES], data[LOSS_MASK], data[REWARD], lengths, gamma=cfg.gamma, lam=cfg.lam)
            data[ADVANTAGES], data[RETURNS] = adv, ret
            sums = value_fit_sums(data[VALUES], ret, data[LOSS_MASK])
        explained = explained_variance(sums)

        for epoch in range(cfg.epochs):
            for rows in minibatch_rows(meta.size, cfg.minibatches, seed=(cfg.seed * 1_000_003 + step) * 101 + epoch):
                part_meta = meta.subset(rows)
                part = None if data is None else data[torch.tensor(rows, dtype=torch.int64)]
                record.metrics = self._train(part_meta, part, cfg.policy_loss(), "policy", record.chunks)
                record.value_metrics = self._train(part_meta, part, cfg.value_loss(), "value", record.chunks)
        record.value_metrics = {**record.value_metrics, "explained_variance": explained}
        record.version = self.policy.version
        return record

    def _train(
        self, meta: KVBatchMeta, data: TensorDictBase | None, loss: Any, model: str, chunks: list[ChunkResult]
    ) -> dict[str, float]:
        cfg = self.config
        if cfg.train_step == "monolithic":
            result = self.policy.train(meta, loss, data=data, model=model)
            chunks.append(result.chunk)
            return result.metrics
        self.policy.begin(loss, model=model)
        for start, stop in even_parts(meta.size, cfg.train_chunks):
            part = None if data is None else data[start:stop]
            chunks.append(self.policy.train_chunk(meta.slice(start, stop), data=part, model=model))
        return self.policy.finish(model=model)
