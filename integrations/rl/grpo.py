"""Synchronous GRPO over the data plane: one rollout, one optimizer step, one weight sync per step.

:class:`GRPO` drives a rollout actor (:class:`~integrations.rl.rollout_actor.RolloutActor`) and a
trainer group (:class:`~integrations.rl.policy.Policy`). One :meth:`GRPO.step`:

1. the rollout actor samples ``group_size`` responses per prompt with the current weights, scores
   them and writes them (``first_write``: keys ``f"{uid}_g{i}"``, tags ``uid``, ``sample_idx``,
   ``weight_version``) into the step's partition; the driver gets the meta and per-row rewards;
2. the driver computes :func:`~integrations.rl.advantages.group_advantages` from ``reward`` and the
   ``uid`` tags;
3. **dynamic sampling**: groups whose rewards are all equal (zero std: nothing to learn) leave the
   meta and the store;
4. ``prev_logprobs`` (policy) and ``ref_logprobs`` (reference model, when ``kl_coef > 0``) are
   computed by the trainers and written back token-aligned; the driver writes ``advantages``;
5. the split train step (``begin``, one ``train_chunk`` per chunk of whole groups, ``finish``) or one
   monolithic ``train`` call;
6. the step's partition is cleared, and the new weights go to the rollout actor.

The driver never reads a bulk tensor: it handles metas, per-row rewards and advantages. On an
error, the open step is aborted (when the group still lives) and the partition cleared before the
error is raised.

**Without a data plane** (``client=None``): the same algorithm, plan and seeds, but the rollout
returns its tensors, the driver holds them and ships each rank's rows with the calls (Ray object
refs), and logprobs come back to the driver; this is how trainers without a data plane move data,
and it ends with bit-identical parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import DataPlaneClient, InvalidArgument, KVBatchMeta
from dataplane.checks import check_int
from integrations.rl.advantages import group_advantages
from integrations.rl.conventions import ADVANTAGES, PREV_LOGPROBS, REF_LOGPROBS, TAG_UID
from integrations.rl.losses import ClippedPolicyLoss, LossType
from integrations.rl.policy import Policy
from integrations.rl.sync_loop import StepRecord, SyncLoop, even_parts
from integrations.rl.weight_sync import WeightSync

__all__ = ["GRPO", "GRPOConfig", "StepRecord", "group_chunks", "zero_std_groups"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOConfig:
    """The algorithm's settings (sampling sizes live on the rollout actor).

    Attributes:
        clip: PPO clip range of the ratio.
        kl_coef: weight of the k3 KL penalty to the reference model (0: no reference pass).
        loss_type: ``"token"`` or ``"sequence"`` normalisation.
        normalize_std: divide advantages by the group's std.
        train_step: ``"split"`` (begin, a ``train_chunk`` per chunk, finish) or ``"monolithic"``.
        train_chunks: chunks of whole groups per split step.
        partition_prefix: step ``s`` uses partition ``f"{partition_prefix}-step{s}"``.
        timeout_s: the most a call to the rollout actor waits.
        sampler_check: report ``sampler_logprob_diff`` (mean) and ``sampler_logprob_diff_max``, how far
            the rollout engine's log-probs are from the trainer's for the same tokens (the trainers
            then also read ``gen_logprobs``); see :func:`~integrations.rl.losses.clipped_policy_loss`.
    """

    clip: float = 0.2
    kl_coef: float = 0.01
    loss_type: LossType = "token"
    normalize_std: bool = True
    train_step: Literal["split", "monolithic"] = "split"
    train_chunks: int = 2
    partition_prefix: str = "grpo"
    timeout_s: float = 300.0
    sampler_check: bool = True

    def __post_init__(self) -> None:
        if self.train_step not in ("split", "monolithic"):
            raise InvalidArgument(f"train_step must be 'split' or 'monolithic', got {self.train_step!r}")
        check_int("train_chunks", self.train_chunks, low=1)
        ClippedPolicyLoss(clip_low=self.clip, kl_coef=self.kl_coef, loss_type=self.loss_type)  # validates

    def loss(self) -> ClippedPolicyLoss:
        return ClippedPolicyLoss(
            clip_low=self.clip, kl_coef=self.kl_coef, loss_type=self.loss_type, sampler_check=self.sampler_check
        )


def zero_std_groups(rewards: Tensor, uids: list[str]) -> list[str]:
    """The uids whose rows all have the same reward, in first-seen order.

    >>> zero_std_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), ["a", "a", "b", "b"])
    ['a']
    """
    return _zero_std(_group_rewards(rewards, uids))


def _group_rewards(rewards: Tensor, uids: list[str]) -> dict[str, list[float]]:
    """uid -> its rows' rewards, in row order (uids in first-seen order)."""
    if rewards.shape != (len(uids),):
        raise InvalidArgument(f"rewards {tuple(rewards.shape)} do not match {len(uids)} uids")
    groups: dict[str, list[float]] = {}
    for uid, r in zip(uids, rewards.tolist(), strict=True):
        groups.setdefault(uid, []).append(r)
    return groups


def _zero_std(groups: dict[str, list[float]]) -> list[str]:
    return [uid for uid, rs in groups.items() if max(rs) == min(rs)]


def group_chunks(uids: list[str], n: int) -> list[list[int]]:
    """Row positions split into at most ``n`` consecutive chunks of whole groups (group counts differ by
    at most one), for a split step that trains a chunk at a time.

    >>> group_chunks(["a", "a", "b", "b", "c", "c"], 2)
    [[0, 1, 2, 3], [4, 5]]
    """
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        groups.setdefault(uid, []).append(i)
    rows = list(groups.values())
    return [[p for g in rows[start:stop] for p in g] for start, stop in even_parts(len(rows), n)]


class GRPO(SyncLoop):
    """Synchronous GRPO; see the module docstring.

    Args:
        policy: the trainer group (its ``"reference"`` model is used when ``config.kl_coef > 0``).
        rollout: a :class:`~integrations.rl.rollout_actor.RolloutActor` Ray actor.
        config: :class:`GRPOConfig`.
        client: the driver's data-plane client (the one the actors joined); None trains without a
            data plane (tensors through the driver).
        weight_sync: how new weights reach the rollout actor (default
            :class:`~integrations.rl.weight_sync.ObjectStoreWeightSync`).
    """

    def __init__(
        self,
        policy: Policy,
        rollout: Any,
        config: GRPOConfig | None = None,
        *,
        client: DataPlaneClient | None = None,
        weight_sync: WeightSync | None = None,
    ) -> None:
        self.config: GRPOConfig = config or GRPOConfig()
        super().__init__(policy, rollout, self.config, client=client, weight_sync=weight_sync)

    def learn(
        self, step: int, partition: str, meta: KVBatchMeta, rewards: Tensor, data: TensorDictBase | None
    ) -> StepRecord:
        cfg = self.config
        uids = [str(t[TAG_UID]) for t in meta.tags or ()]
        if len(uids) != meta.size:
            raise InvalidArgument("the rollout's meta has no uid tag per row; write rollouts with first_write")
        advantages = group_advantages(rewards, uids, normalize_std=cfg.normalize_std)
        groups = _group_rewards(rewards, uids)
        dropped = _zero_std(groups)
        gone = set(dropped)
        keep = [i for i, uid in enumerate(uids) if uid not in gone]
        record = StepRecord(
            step=step,
            partition_id=partition,
            reward_mean=float(rewards.double().mean()),
            group_rewards=groups,
            dropped_groups=dropped,
            rows_trained=len(keep),
            version=self.policy.version,
        )
        if self.client is not None and dropped:
            self.client.kv_clear([meta.keys[i] for i in range(meta.size) if uids[i] in gone], partition_id=partition)
        meta = meta.subset(keep)
        if data is not None:
            data = data[torch.tensor(keep, dtype=torch.int64)]
        if not keep:
            return record  # nothing to learn from: no step, the version stays

        meta, data = self.forward("logprobs", meta, data, PREV_LOGPROBS, "policy")
        if cfg.kl_coef > 0:
            meta, data = self.forward("logprobs", meta, data, REF_LOGPROBS, "reference")
        meta = self.put_rows(partition, meta, data, {ADVANTAGES: advantages[keep]})
        loss = cfg.loss()
        if cfg.train_step == "monolithic":
            result = self.policy.train(meta, loss, data=data)
            record.metrics, record.chunks = result.metrics, [result.chunk]
        else:
            self.policy.begin(loss)
            for rows in group_chunks([uids[i] for i in keep], cfg.train_chunks):
                part = None if data is None else data[torch.tensor(rows, dtype=torch.int64)]
                record.chunks.append(self.policy.train_chunk(meta.subset(rows), data=part))
            record.metrics = self.policy.finish()
        record.version = self.policy.version
        return record
