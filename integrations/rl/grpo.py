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

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import DataPlaneClient, InvalidArgument, KVBatchMeta
from integrations.rl.advantages import group_advantages
from integrations.rl.conventions import ADVANTAGES, INPUT_IDS, PREV_LOGPROBS, REF_LOGPROBS, TAG_UID, token_mask
from integrations.rl.losses import ClippedPolicyLoss, LossType
from integrations.rl.metering import TrafficMeter, add_totals
from integrations.rl.policy import ChunkResult, Policy, gather
from integrations.rl.weight_sync import ObjectStoreWeightSync, WeightSync

__all__ = ["GRPO", "GRPOConfig", "StepRecord", "group_chunks", "zero_std_groups"]

log = logging.getLogger(__name__)


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
    """

    clip: float = 0.2
    kl_coef: float = 0.01
    loss_type: LossType = "token"
    normalize_std: bool = True
    train_step: Literal["split", "monolithic"] = "split"
    train_chunks: int = 2
    partition_prefix: str = "grpo"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.train_step not in ("split", "monolithic"):
            raise InvalidArgument(f"train_step must be 'split' or 'monolithic', got {self.train_step!r}")
        if isinstance(self.train_chunks, bool) or not isinstance(self.train_chunks, int) or self.train_chunks < 1:
            raise InvalidArgument(f"train_chunks must be an int >= 1, got {self.train_chunks!r}")
        ClippedPolicyLoss(clip_low=self.clip, kl_coef=self.kl_coef, loss_type=self.loss_type)  # validates

    def loss(self) -> ClippedPolicyLoss:
        return ClippedPolicyLoss(clip_low=self.clip, kl_coef=self.kl_coef, loss_type=self.loss_type)


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One step, as the driver saw it.

    Attributes:
        step, partition_id: which step, and the partition its rows lived in.
        reward_mean: mean reward of every sampled row (before dynamic sampling).
        group_rewards: uid -> the group's rewards, in sample order.
        dropped_groups: uids dynamic sampling dropped (all rewards equal).
        rows_trained: rows that reached the train step.
        metrics: the train step's metrics (``loss``, ``kl``, ``grad_norm``, ...); empty when every
            group was dropped and nothing trained.
        version: the policy's version after the step (moves only when a step finished).
        chunks: the shards and per-rank microbatches of each train call.
        seconds, rollout_seconds, train_seconds: wall time of the step, of the rollout call, of training.
        traffic: the step's data-plane totals over every process (driver, rollout, trainers).
        driver_traffic: the driver's own share.
    """

    step: int
    partition_id: str
    reward_mean: float
    group_rewards: dict[str, list[float]]
    dropped_groups: list[str]
    rows_trained: int
    metrics: dict[str, float] = field(default_factory=dict)
    version: int = 0
    chunks: list[ChunkResult] = field(default_factory=list)
    seconds: float = 0.0
    rollout_seconds: float = 0.0
    train_seconds: float = 0.0
    traffic: dict[str, float] = field(default_factory=dict)
    driver_traffic: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The step as one flat, JSON-ready dict."""
        return {
            "step": self.step,
            "reward_mean": self.reward_mean,
            "loss": self.metrics.get("loss"),
            "kl": self.metrics.get("kl"),
            "grad_norm": self.metrics.get("grad_norm"),
            "groups": len(self.group_rewards),
            "dropped_groups": len(self.dropped_groups),
            "rows_trained": self.rows_trained,
            "version": self.version,
            "seconds": self.seconds,
            "rollout_seconds": self.rollout_seconds,
            "train_seconds": self.train_seconds,
            "data_plane_seconds": self.traffic.get("seconds", 0.0),
            "bytes_put": self.traffic.get("bytes_put", 0),
            "bytes_get": self.traffic.get("bytes_get", 0),
        }


def zero_std_groups(rewards: Tensor, uids: list[str]) -> list[str]:
    """The uids whose rows all have the same reward, in first-seen order.

    >>> zero_std_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), ["a", "a", "b", "b"])
    ['a']
    """
    if rewards.shape != (len(uids),):
        raise InvalidArgument(f"rewards {tuple(rewards.shape)} do not match {len(uids)} uids")
    seen: dict[str, list[float]] = {}
    for uid, r in zip(uids, rewards.tolist(), strict=True):
        seen.setdefault(uid, []).append(r)
    return [uid for uid, rs in seen.items() if max(rs) == min(rs)]


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
    n = max(1, min(n, len(rows)))
    size, rest = divmod(len(rows), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < rest else 0)
        out.append([p for g in rows[start:stop] for p in g])
        start = stop
    return out


class GRPO:
    """Synchronous GRPO; see the module docstring.

    Args:
        policy: the trainer group (its ``"reference"`` model is used when ``config.kl_coef > 0``).
        rollout: a :class:`~integrations.rl.rollout_actor.RolloutActor` Ray actor.
        config: :class:`GRPOConfig`.
        client: the driver's data-plane client (the one the actors joined); None trains without a
            data plane (tensors through the driver).
        weight_sync: how new weights reach the rollout actor (default :class:`ObjectStoreWeightSync`).
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
        self.policy, self.rollout = policy, rollout
        self.config = config or GRPOConfig()
        self.weight_sync = weight_sync or ObjectStoreWeightSync(self.config.timeout_s)
        self.meter = TrafficMeter()
        self.client = None if client is None else self.meter.wrap(client)
        if client is not None and not client.capabilities.cross_process:
            raise InvalidArgument(
                f"the {client.capabilities.backend} backend keeps rows in one process, and the rollout and trainer "
                "actors are processes of their own: use mooncake://local or tq://?backend=simple"
            )

    @property
    def inline(self) -> bool:
        """Whether tensors travel through the driver (no data plane)."""
        return self.client is None

    def sync_weights(self) -> None:
        """Push the policy's weights to the rollout actor (before the first step, and after each)."""
        self.weight_sync.push(self.policy, self.rollout, self.policy.version)

    def _call_rollout(self, ref: Any, what: str) -> Any:
        return gather([ref], timeout_s=self.config.timeout_s, what=what, names=["rollout"])[0]

    def traffic(self) -> dict[str, float]:
        """Data-plane totals so far over every process: driver, rollout actor, trainer ranks."""
        rollout = self._call_rollout(self.rollout.traffic.remote(), "traffic")
        return add_totals(self.meter.totals(), rollout, *self.policy.traffic())

    def step(self, step: int) -> StepRecord:
        """One GRPO step (see the module docstring); returns what happened."""
        t0 = time.perf_counter()
        before = self.traffic()
        driver_before = self.meter.totals()
        partition = f"{self.config.partition_prefix}-step{step}"
        try:  # a rollout that failed may have written some rows: the clean-up clears them too
            ro = self._call_rollout(self.rollout.rollout.remote(step, partition, write=not self.inline), "rollout")
            t_rollout = time.perf_counter() - t0
            record = self._learn(step, partition, ro.meta, ro.rewards, ro.data)
        except BaseException:
            self._clean_up_failed(partition)
            raise
        if self.client is not None:
            self.client.kv_clear(partition_id=partition)
        if record.metrics:
            self.sync_weights()
        record.rollout_seconds = t_rollout
        record.traffic = add_totals(self.traffic(), before, sign=-1)
        record.driver_traffic = add_totals(self.meter.totals(), driver_before, sign=-1)
        record.seconds = time.perf_counter() - t0
        return record

    def _clean_up_failed(self, partition: str) -> None:
        if self.policy.broken is None:
            try:
                self.policy.abort()
            except Exception:
                log.exception("grpo: aborting the train step after a failure failed too")
        if self.client is not None:
            try:
                self.client.kv_clear(partition_id=partition)
            except Exception:
                log.exception("grpo: clearing partition %r after a failure failed too", partition)

    def _learn(
        self, step: int, partition: str, meta: KVBatchMeta, rewards: Tensor, data: TensorDictBase | None
    ) -> StepRecord:
        cfg = self.config
        uids = [str(t[TAG_UID]) for t in meta.tags or ()]
        if len(uids) != meta.size:
            raise InvalidArgument("the rollout's meta has no uid tag per row; write rollouts with first_write")
        advantages = group_advantages(rewards, uids, normalize_std=cfg.normalize_std)
        groups: dict[str, list[float]] = {}
        for uid, r in zip(uids, rewards.tolist(), strict=True):
            groups.setdefault(uid, []).append(r)
        dropped = zero_std_groups(rewards, uids)
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
        advantages = advantages[keep]
        if data is not None:
            data = data[torch.tensor(keep, dtype=torch.int64)]
        if not keep:
            return record  # nothing to learn from: no step, the version stays

        t_train = time.perf_counter()
        meta, data = self._logprobs(meta, data, PREV_LOGPROBS, "policy")
        if cfg.kl_coef > 0:
            meta, data = self._logprobs(meta, data, REF_LOGPROBS, "reference")
        if data is None:
            assert self.client is not None
            self.client.kv_batch_put(list(meta.keys), {ADVANTAGES: advantages}, partition_id=partition)
            meta = meta.with_fields([ADVANTAGES])
        else:
            data[ADVANTAGES] = advantages
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
        record.train_seconds = time.perf_counter() - t_train
        return record

    def _logprobs(
        self, meta: KVBatchMeta, data: TensorDictBase | None, out_field: str, model: str
    ) -> tuple[KVBatchMeta, TensorDictBase | None]:
        if data is None:
            written = self.policy.logprobs(meta, out_field, model=model)
            assert isinstance(written, KVBatchMeta)
            return written, None
        out = self.policy.logprobs(meta, out_field, model=model, data=data)
        assert isinstance(out, Tensor)
        # what a write-back and a padded read give: the row's own tokens, zeros past its length
        lengths = torch.tensor(meta.sequence_lengths or (), dtype=torch.int64)
        width = int(data[INPUT_IDS].shape[1])
        full = out.new_zeros(out.shape[0], max(width, int(out.shape[1])))
        full[:, : out.shape[1]] = out
        full = torch.where(token_mask(lengths, full.shape[1]), full, torch.zeros_like(full))
        data[out_field] = full[:, :width]
        return meta, data
