"""One training rank as a Ray actor: the split train step, logprobs, weights, over the data plane or inline.

:class:`TrainerActor` is a plain class; :class:`~integrations.rl.policy.Policy` makes it a Ray actor
(one per rank, ``ray.remote(TrainerActor)``) and drives the group. Each actor joins one
``torch.distributed`` group with its peers, builds its models from picklable factories (the
reference worker for the tiny model, or your own :class:`~integrations.rl.workers.DTensorRLWorkerMixin`
host), and exposes, per model name (``"policy"``, ``"reference"``, ``"value"``, ...):

* ``logprobs(model, shard, out_field, data=None)`` and ``values(...)``: the shard's token-aligned
  logprobs or values, written back from the replica leader (``data is None``: read from the data
  plane) or returned (``data`` given: the shard's tensors arrived with the call, the way a trainer
  without a data plane gets them);
* ``sequence_gae(shard, gamma, lam)``: PPO's advantage stage on the shard, written back;
* the split step: ``begin(loss_fn, model)``, ``train_chunk(shard, data, model)``, ``finish(model)``,
  ``abort(model)``, and ``train(shard, loss_fn, data, model)`` for all of it in one call.
  ``version(model)`` is the number of finished steps: it moves on ``finish`` only, never on ``abort``;
* ``state_dict_ref(model)`` (a collective; rank 0 returns an object ref of the whole parameters) and
  ``param_digest(model)``.

Ray is imported only inside the methods that need it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import InvalidArgument, KVBatchMeta
from integrations.rl.advantages import sequence_gae, value_fit_sums
from integrations.rl.conventions import ADVANTAGES, INPUT_IDS, LOSS_MASK, PREV_LOGPROBS, RETURNS, REWARD, VALUES
from integrations.rl.metering import TrafficMeter
from integrations.rl.split_step import TrainStepError
from integrations.rl.workers.dtensor import DTensorRLWorkerMixin, full_parameters

__all__ = ["ChunkReport", "ParamDigest", "TrainerActor", "param_digest", "row_fingerprint"]

WorkerFactory = Callable[[], DTensorRLWorkerMixin]


@dataclass(frozen=True, slots=True)
class ChunkReport:
    """What one rank trained in a chunk: per planned microbatch, the row keys in the order trained
    (``[]`` for a dummy), the :func:`row_fingerprint` of each row's ``input_ids`` as the rank had them,
    and each microbatch's local metrics."""

    rank: int
    microbatches: list[list[str]]
    fingerprints: list[list[int]] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ParamDigest:
    """``sha256`` of every parameter as float32 bytes in ``state_dict`` order; ``norm``: float64 L2 norm."""

    sha256: str
    norm: float


def row_fingerprint(ids: Tensor) -> int:
    """A cheap fingerprint of one row's token ids: ``sum((t + 1) * ids[t])`` (padding zeros add nothing).

    >>> row_fingerprint(torch.tensor([3, 1, 0, 0]))
    5
    """
    weights = torch.arange(1, ids.shape[-1] + 1, device=ids.device, dtype=torch.int64)
    return int((ids.long() * weights).sum())


def param_digest(params: Mapping[str, Tensor]) -> ParamDigest:
    """Digest of whole parameters (name -> tensor, in ``state_dict`` order).

    >>> param_digest({"w": torch.ones(2)}).norm
    1.4142135623730951
    """
    h = hashlib.sha256()
    sq = torch.zeros((), dtype=torch.float64)
    for t in params.values():
        flat = t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
        h.update(flat.numpy().tobytes())
        sq += flat.double().square().sum()
    return ParamDigest(sha256=h.hexdigest(), norm=float(sq.sqrt()))


class TrainerActor:
    """One rank of a training group; see the module docstring. Methods other than :meth:`node_address`,
    :meth:`free_port`, :meth:`traffic` and :meth:`version` are collectives: call them on every rank.

    Args:
        rank, world: this rank and the group size.
        threads: torch intra-op threads (1 suits many ranks per host; more for one rank per host).
    """

    def __init__(self, rank: int, world: int, *, threads: int = 1) -> None:
        if not 0 <= rank < world:
            raise InvalidArgument(f"rank {rank} must be in [0, {world})")
        self.rank, self.world = rank, world
        torch.set_num_threads(threads)
        # Gathering TP x FSDP parameters for a weight sync takes two all-gathers, and torch warns each time.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.workers: dict[str, DTensorRLWorkerMixin] = {}
        self.meter = TrafficMeter()
        self._client: Any = None
        self._losses: dict[str, Any] = {}  # model -> the loss of its open step

    # -- setup ------------------------------------------------------------------------------------
    def node_address(self) -> str:
        """This actor's host address as Ray sees it (where rank 0 serves the rendezvous)."""
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def free_port(self) -> int:
        """A port free on this host now (for the rendezvous rank 0 serves)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def init_process_group(self, address: str, port: int, *, backend: str = "gloo", timeout_s: float = 300.0) -> int:
        """Join the group (``tcp://address:port``, rank 0 serves it); returns this process id."""
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                init_method=f"tcp://{address}:{port}",
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(seconds=timeout_s),
            )
        return os.getpid()

    def build(self, factories: Mapping[str, WorkerFactory]) -> None:
        """(Re)build the named workers (a collective): ``{"policy": factory, "reference": factory}``.

        Every rank passes the same factories (the same seeds), so all start from the same weights.
        A rebuilt worker starts at version 0 with fresh optimizer state.
        """
        if "policy" not in factories:
            raise InvalidArgument(f"factories need a 'policy' worker, got {sorted(factories)}")
        self.workers = {}
        for name, factory in factories.items():
            worker = factory()
            if not isinstance(worker, DTensorRLWorkerMixin):
                raise InvalidArgument(f"factory {name!r} built a {type(worker).__name__}, not a DTensorRLWorkerMixin")
            self.workers[name] = worker
        self._attach()

    def connect(self, url: str | None) -> None:
        """Use the data plane at ``url`` (a joinable ``client.url``), or none (``None``: inline only)."""
        for worker in self.workers.values():
            worker.close_data_plane()  # before the client they use closes
        self._client = self.meter.reconnect(self._client, url)
        self._attach()

    def _attach(self) -> None:
        for worker in self.workers.values():
            worker.close_data_plane()
            if self._client is not None:
                worker.setup_data_plane(self._client)

    def close(self) -> None:
        """Close the data-plane client (the process group stays until the actor exits)."""
        self.connect(None)

    # -- work ------------------------------------------------------------------------------------
    def _worker(self, model: str) -> DTensorRLWorkerMixin:
        try:
            return self.workers[model]
        except KeyError:
            raise InvalidArgument(f"no worker {model!r} here (built: {sorted(self.workers)}); build() it") from None

    def _local(self, worker: DTensorRLWorkerMixin, data: TensorDictBase) -> TensorDictBase:
        return data.to(worker.compute_device())

    def logprobs(
        self, model: str, shard: KVBatchMeta, out_field: str = PREV_LOGPROBS, data: TensorDictBase | None = None
    ) -> KVBatchMeta | Tensor | None:
        """Token-aligned logprobs of the shard's rows under ``model``.

        Without ``data``: read ``input_ids`` from the data plane and write ``out_field`` back from the
        replica leader; returns the written meta there, None on its siblings. With ``data`` (the
        shard's padded tensors): return ``[rows, width]`` float32 on the replica leader, None elsewhere.
        """
        worker = self._worker(model)
        if data is None:
            return worker.get_logprobs_presharded(shard, out_field)
        out = worker.forward_logprobs(self._local(worker, data), shard)
        return out if worker.is_writeback_leader() else None

    def values(
        self, model: str, shard: KVBatchMeta, out_field: str = VALUES, data: TensorDictBase | None = None
    ) -> KVBatchMeta | Tensor | None:
        """Token-aligned values ``V(s_t)`` of the shard's rows under the value model ``model``; written
        back or returned like :meth:`logprobs`."""
        worker = self._worker(model)
        if data is None:
            return worker.get_values_presharded(shard, out_field)
        out = worker.forward_values(self._local(worker, data), shard)
        return out if worker.is_writeback_leader() else None

    def sequence_gae(
        self, shard: KVBatchMeta, gamma: float, lam: float, model: str = "value"
    ) -> tuple[KVBatchMeta | None, dict[str, float]]:
        """PPO's advantage stage on this shard: read ``values``, ``loss_mask`` and ``reward``, run
        :func:`~integrations.rl.advantages.sequence_gae`, write ``advantages`` and ``returns`` back
        (the replica leader). Returns the written meta (None on siblings) and the shard's
        :func:`~integrations.rl.advantages.value_fit_sums` (zeros on siblings: add the leaders')."""
        worker = self._worker(model)
        data = worker.fetch_agreed(shard, [VALUES, LOSS_MASK, REWARD])  # every rank: a sibling's read is a broadcast
        if not worker.is_writeback_leader():
            return None, value_fit_sums(torch.zeros(0, 1), torch.zeros(0, 1), torch.zeros(0, 1))
        if shard.size == 0:
            return shard, value_fit_sums(torch.zeros(0, 1), torch.zeros(0, 1), torch.zeros(0, 1))
        lengths = torch.tensor(shard.sequence_lengths or (), dtype=torch.int64)
        values, mask = data[VALUES].cpu(), data[LOSS_MASK].cpu()
        adv, ret = sequence_gae(values, mask, data[REWARD].cpu(), lengths, gamma=gamma, lam=lam)
        written = worker.write_back(shard, {ADVANTAGES: adv, RETURNS: ret}, token_fields=[ADVANTAGES, RETURNS])
        return written, value_fit_sums(values, ret, mask)

    def begin(self, loss_fn: Any, model: str = "policy") -> None:
        """Open a train step of ``model`` with ``loss_fn``."""
        self._worker(model).begin_train_step(loss_fn)
        self._losses[model] = loss_fn

    def train_chunk(self, shard: KVBatchMeta, data: TensorDictBase | None = None, model: str = "policy") -> ChunkReport:
        """Train the shard's planned microbatches into the open step (read from the data plane, or ``data``)."""
        worker = self._worker(model)
        loss_fn = self._losses.get(model)
        if loss_fn is None or not worker.train_step_open:
            raise TrainStepError("train_chunk() needs an open step; call begin(loss_fn) first")
        if data is None:
            data = worker.fetch_agreed(shard, worker.train_fields(loss_fn))
        data = self._local(worker, data)  # a no-op for what the fetch put there already
        metrics = worker.train_microbatches(data, shard)
        plan = shard.extra_info.get("microbatches")
        if plan is None:
            plan = [list(range(shard.size))] if shard.size else []
        plan = plan + [[] for _ in range(len(metrics) - len(plan))]
        ids = data[INPUT_IDS]
        return ChunkReport(
            rank=self.rank,
            microbatches=[[shard.keys[i] for i in positions] for positions in plan],
            fingerprints=[[row_fingerprint(ids[i]) for i in positions] for positions in plan],
            metrics=metrics,
        )

    def finish(self, model: str = "policy") -> dict[str, float]:
        """Finish the open step (normalise, clip, step); its metrics, the same on every rank."""
        return self._worker(model).finish_train_step()

    def abort(self, model: str | None = "policy") -> None:
        """Drop ``model``'s open step (None: every model's), if any (idempotent): parameters, optimizer
        state and version untouched."""
        for worker in self.workers.values() if model is None else [self._worker(model)]:
            worker.abort_train_step()

    def train(
        self, shard: KVBatchMeta, loss_fn: Any, data: TensorDictBase | None = None, model: str = "policy"
    ) -> tuple[ChunkReport, dict[str, float]]:
        """``begin``, ``train_chunk``, ``finish`` in one call (aborted and re-raised on an exception)."""
        self.begin(loss_fn, model)
        try:
            report = self.train_chunk(shard, data, model)
            return report, self.finish(model)
        except BaseException:
            self._worker(model).abort_train_step()
            raise

    def version(self, model: str = "policy") -> int:
        """Finished steps of ``model``: moves on ``finish`` only."""
        return int(self._worker(model).weight_version)

    def state_dict_ref(self, model: str = "policy") -> Any:
        """Whole parameters on the CPU (a collective): rank 0 puts them in Ray's object store and returns
        the ref (a weight sync hands it to the rollout actor; the driver never holds the tensors), the
        others None."""
        import ray

        params = full_parameters(self._worker(model).model)
        return ray.put(params) if self.rank == 0 else None

    def param_digest(self, model: str = "policy") -> ParamDigest:
        """:func:`param_digest` of the whole parameters (a collective; the same on every rank)."""
        return param_digest(full_parameters(self._worker(model).model))

    def traffic(self) -> dict[str, float]:
        """This process's data-plane totals (:meth:`~integrations.rl.metering.TrafficMeter.totals`)."""
        return self.meter.totals()
