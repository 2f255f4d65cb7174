"""What every synchronous RL step over Ray actors shares: rollout, the step's partition, clean-up, traffic.

:class:`SyncLoop` runs one step as: the rollout actor samples and writes into the step's partition
(``f"{partition_prefix}-step{s}"``) and returns the meta and per-row rewards -> the algorithm's
:meth:`~SyncLoop.learn` (GRPO, PPO) -> the partition is cleared -> new weights go to the rollout
actor when a step finished. On an error the open train steps are aborted (when the trainer group
still lives) and the partition is cleared before the error is raised. The driver never reads a
bulk tensor.

Without a data plane (``client=None``) the rollout returns its tensors, the driver holds them and
ships each rank's rows with the calls; :meth:`~SyncLoop.forward` gives what a write-back and a
padded read would (zeros past each row), so both ways train on the same bits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import DataPlaneClient, InvalidArgument, KVBatchMeta
from integrations.rl.conventions import INPUT_IDS, token_mask
from integrations.rl.metering import TrafficMeter, add_totals
from integrations.rl.policy import ChunkResult, Policy, gather
from integrations.rl.weight_sync import ObjectStoreWeightSync, WeightSync

__all__ = ["StepRecord", "SyncLoop"]

log = logging.getLogger(__name__)


def even_parts(count: int, n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of at most ``n`` consecutive parts of ``range(count)`` whose sizes differ by at
    most one (the first ones larger); one empty part when ``count`` is 0. How GRPO cuts its groups into
    train chunks (:func:`~integrations.rl.grpo.group_chunks`) and PPO its rows into minibatches and chunks.

    >>> even_parts(5, 2), even_parts(2, 4), even_parts(0, 3)
    ([(0, 3), (3, 5)], [(0, 1), (1, 2)], [(0, 0)])
    """
    n = max(1, min(n, count))
    size, rest = divmod(count, n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < rest else 0)
        out.append((start, stop))
        start = stop
    return out


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One step, as the driver saw it.

    Attributes:
        step, partition_id: which step, and the partition its rows lived in.
        reward_mean: mean reward of every sampled row.
        rows_trained: rows that reached the train step.
        metrics: the policy's train metrics (``loss``, ``kl``, ``grad_norm``, ...; the last optimizer
            step's when a step takes several); empty when nothing trained.
        value_metrics: the value model's (PPO), with ``explained_variance``.
        version: the policy's version after the step (moves only when a train step finished).
        chunks: the shards and per-rank microbatches of each train call.
        group_rewards: uid -> the group's rewards, in sample order.
        dropped_groups: uids dynamic sampling dropped (GRPO: all rewards equal).
        seconds, rollout_seconds, train_seconds: wall time of the step, of the rollout call, of training.
        weight_sync_seconds: pushing the new weights to the rollout side after the step.
        traffic: the step's data-plane totals over every process (driver, rollout, trainers).
        driver_traffic: the driver's own share.
        trainer_data_seconds, trainer_compute_seconds: the step's trainer calls, per rank (the mean
            over the ranks): seconds moving data (data-plane reads and write-backs; without a data
            plane, the rows shipped with the calls copied to the compute device) and the rest
            (forward, backward, optimizer, the step's collectives). Weight syncs count in neither.
    """

    step: int
    partition_id: str
    reward_mean: float
    rows_trained: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    value_metrics: dict[str, float] = field(default_factory=dict)
    version: int = 0
    chunks: list[ChunkResult] = field(default_factory=list)
    group_rewards: dict[str, list[float]] = field(default_factory=dict)
    dropped_groups: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rollout_seconds: float = 0.0
    train_seconds: float = 0.0
    weight_sync_seconds: float = 0.0
    traffic: dict[str, float] = field(default_factory=dict)
    driver_traffic: dict[str, float] = field(default_factory=dict)
    trainer_data_seconds: float = 0.0
    trainer_compute_seconds: float = 0.0

    def set_traffic(self, traffic: dict[str, float], ranks: int) -> None:
        """Keep the step's ``traffic`` (:func:`~integrations.rl.metering.add_totals` of every process's
        difference) and its trainer times per rank (``ranks`` trainer ranks)."""
        self.traffic = traffic
        self.trainer_data_seconds = traffic.get("trainer_data_seconds", 0.0) / ranks
        self.trainer_compute_seconds = traffic.get("trainer_compute_seconds", 0.0) / ranks

    def summary(self) -> dict[str, Any]:
        """The step as one flat, JSON-ready dict."""
        rewards = [r for group in self.group_rewards.values() for r in group]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        got = self.traffic.get("bytes_get", 0)
        out = {
            "step": self.step,
            "reward_mean": self.reward_mean,
            "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else 0.0,
            "reward_max": max(rewards, default=0.0),
            "loss": self.metrics.get("loss"),
            "kl": self.metrics.get("kl"),
            "grad_norm": self.metrics.get("grad_norm"),
            "lr": self.metrics.get("lr"),
            "entropy": self.metrics.get("entropy"),
            "real_token_share": self.metrics.get("real_token_share"),
            "sampler_logprob_diff": self.metrics.get("sampler_logprob_diff"),
            "sampler_logprob_diff_max": self.metrics.get("sampler_logprob_diff_max"),
            "groups": len(self.group_rewards),
            "dropped_groups": len(self.dropped_groups),
            "rows_trained": self.rows_trained,
            "version": self.version,
            "seconds": self.seconds,
            "rollout_seconds": self.rollout_seconds,
            "train_seconds": self.train_seconds,
            "weight_sync_seconds": self.weight_sync_seconds,
            "data_plane_seconds": self.traffic.get("seconds", 0.0),
            "trainer_data_seconds": self.trainer_data_seconds,
            "trainer_compute_seconds": self.trainer_compute_seconds,
            "bytes_put": self.traffic.get("bytes_put", 0),
            "bytes_get": got,
            "driver_bytes_share": self.driver_traffic.get("bytes_get", 0) / got if got else 0.0,
        }
        if self.value_metrics:
            out["value_loss"] = self.value_metrics.get("loss")
            out["explained_variance"] = self.value_metrics.get("explained_variance")
        return out


class SyncLoop:
    """The shared step envelope; subclasses implement :meth:`learn`.

    Args:
        policy: the trainer group.
        rollout: a :class:`~integrations.rl.rollout_actor.RolloutActor` Ray actor.
        config: the algorithm's settings; this reads ``partition_prefix`` (step ``s`` uses partition
            ``f"{partition_prefix}-step{s}"``) and ``timeout_s`` (the most a call to the rollout
            actor waits).
        client: the driver's data-plane client (the one the actors joined); None trains without a
            data plane (tensors through the driver).
        weight_sync: how new weights reach the rollout actor (default :class:`ObjectStoreWeightSync`).
    """

    def __init__(
        self,
        policy: Policy,
        rollout: Any,
        config: Any,
        *,
        client: DataPlaneClient | None = None,
        weight_sync: WeightSync | None = None,
    ) -> None:
        if client is not None and not client.capabilities.cross_process:
            raise InvalidArgument(
                f"the {client.capabilities.backend} backend keeps rows in one process, and the rollout and trainer "
                "actors are processes of their own: use mooncake://local or tq://?backend=simple"
            )
        self.policy, self.rollout = policy, rollout
        self.timeout_s = float(config.timeout_s)
        self.partition_prefix = str(config.partition_prefix)
        self.weight_sync = weight_sync or ObjectStoreWeightSync(self.timeout_s)
        self.meter = TrafficMeter()
        self.client = None if client is None else self.meter.wrap(client)

    @property
    def inline(self) -> bool:
        """Whether tensors travel through the driver (no data plane)."""
        return self.client is None

    def sync_weights(self) -> None:
        """Push the policy's weights to the rollout actor (before the first step, and after each)."""
        self.weight_sync.push(self.policy, self.rollout, self.policy.version)

    def _call_rollout(self, ref: Any, what: str) -> Any:
        return gather([ref], timeout_s=self.timeout_s, what=what, names=["rollout"])[0]

    def traffic(self) -> dict[str, float]:
        """Data-plane totals so far over every process: driver, rollout actor, trainer ranks."""
        rollout = self._call_rollout(self.rollout.traffic.remote(), "traffic")
        return add_totals(self.meter.totals(), rollout, *self.policy.traffic())

    def step(self, step: int) -> StepRecord:
        """One step (see the module docstring); returns what happened."""
        t0 = time.perf_counter()
        before = self.traffic()
        driver_before = self.meter.totals()
        partition = f"{self.partition_prefix}-step{step}"
        try:  # a rollout that failed may have written some rows: the clean-up clears them too
            ro = self._call_rollout(self.rollout.rollout.remote(step, partition, write=not self.inline), "rollout")
            t_rollout = time.perf_counter() - t0
            t_learn = time.perf_counter()
            record = self.learn(step, partition, ro.meta, ro.rewards, ro.data)
            record.train_seconds = time.perf_counter() - t_learn
        except BaseException:
            self._clean_up_failed(partition)
            raise
        if self.client is not None:
            self.client.kv_clear(partition_id=partition)
        if record.metrics:
            t_sync = time.perf_counter()
            self.sync_weights()
            record.weight_sync_seconds = time.perf_counter() - t_sync
        record.rollout_seconds = t_rollout
        record.set_traffic(add_totals(self.traffic(), before, sign=-1), len(self.policy.actors))
        record.driver_traffic = add_totals(self.meter.totals(), driver_before, sign=-1)
        record.seconds = time.perf_counter() - t0
        return record

    def learn(
        self, step: int, partition: str, meta: KVBatchMeta, rewards: Tensor, data: TensorDictBase | None
    ) -> StepRecord:
        """The algorithm: from a written rollout (``data`` holds its tensors when there is no data plane)
        to finished train steps. The caller clears the partition and syncs weights."""
        raise NotImplementedError

    def _clean_up_failed(self, partition: str) -> None:
        if self.policy.broken is None:
            try:
                self.policy.abort()
            except Exception:
                log.exception("rl: aborting the train steps after a failure failed too")
        if self.client is not None:
            try:
                self.client.kv_clear(partition_id=partition)
            except Exception:
                log.exception("rl: clearing partition %r after a failure failed too", partition)

    def forward(
        self, kind: str, meta: KVBatchMeta, data: TensorDictBase | None, out_field: str, model: str
    ) -> tuple[KVBatchMeta, TensorDictBase | None]:
        """``policy.logprobs`` / ``policy.values`` (``kind``) of ``meta``'s rows into ``out_field``:
        written back by the trainers, or (without a data plane) put into ``data`` as a write-back and
        a padded read would leave it: the row's own tokens, zeros past its length."""
        call = self.policy.logprobs if kind == "logprobs" else self.policy.values
        if data is None:
            written = call(meta, out_field, model=model)
            assert isinstance(written, KVBatchMeta)
            return written, None
        out = call(meta, out_field, model=model, data=data)
        assert isinstance(out, Tensor)
        lengths = torch.tensor(meta.sequence_lengths or (), dtype=torch.int64)
        width = int(data[INPUT_IDS].shape[1])
        full = out.new_zeros(out.shape[0], max(width, int(out.shape[1])))
        full[:, : out.shape[1]] = out
        full = torch.where(token_mask(lengths, full.shape[1]), full, torch.zeros_like(full))
        data[out_field] = full[:, :width]
        return meta, data

    def put_rows(
        self, partition: str, meta: KVBatchMeta, data: TensorDictBase | None, fields: dict[str, Tensor]
    ) -> KVBatchMeta:
        """Per-row values the driver computed (``[rows]``, small) into the store, or into ``data``."""
        if data is None:
            assert self.client is not None
            self.client.kv_batch_put(list(meta.keys), fields, partition_id=partition)
            return meta.with_fields(list(fields))
        for name, value in fields.items():
            data[name] = value
        return meta
