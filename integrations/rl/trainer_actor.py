"""One training rank as a Ray actor: the split train step, logprobs, weights, over the data plane or inline.

:class:`TrainerActor` is a plain class; :class:`~integrations.rl.policy.Policy` makes it a Ray actor
(one per rank, ``ray.remote(TrainerActor)``) and drives the group. Each actor joins one
``torch.distributed`` group with its peers, builds its models from picklable factories of any
:class:`~integrations.rl.workers.RLWorkerMixin` (the tiny FSDP2 worker, the Hugging Face worker, a
Megatron worker, or your own; see :mod:`integrations.rl.workers.build`), after setting up once what
their class needs on the group's ``dp x tp x pp`` layout (Megatron's ``parallel_state``; torn down
before a rebuild), and exposes, per model name (``"policy"``, ``"reference"``, ``"value"``, ...):

* ``logprobs(model, shard, out_field, data=None)`` and ``values(...)``: the shard's token-aligned
  logprobs or values, written back from the replica leader (``data is None``: read from the data
  plane) or returned (``data`` given: the shard's tensors arrived with the call, the way a trainer
  without a data plane gets them);
* ``sequence_gae(shard, gamma, lam)``: PPO's advantage stage on the shard, written back;
* the split step: ``begin(loss_fn, model)``, ``train_chunk(shard, data, model)``, ``finish(model)``,
  ``abort(model)``, and ``train(shard, loss_fn, data, model)`` for all of it in one call.
  ``version(model)`` is the number of finished steps: it moves on ``finish`` only, never on ``abort``;
* ``state_dict_ref(model)`` (a collective; rank 0 returns an object ref of the whole parameters under
  the rollout model's names: the worker's ``export_weights()``) and ``param_digest(model)``;
* ``traffic()``: this process's data-plane totals, and where its step calls spent their time
  (:class:`StepClock`): moving data (reads and write-backs through the data plane, or the rows shipped
  with a call copied to the compute device) against the rest (forward, backward, optimizer, the
  step's collectives); ``describe()``: the rank's device and process-group backend.

On GPUs (``init_process_group(backend="nccl")``) each rank uses one CUDA device: the only one it
sees (a Ray actor with ``num_gpus=1``: Ray sets ``CUDA_VISIBLE_DEVICES``), else ``rank % count``.

Ray is imported only inside the methods that need it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import InvalidArgument, KVBatchMeta
from dataplane.checks import check_int
from integrations.rl.advantages import sequence_gae, value_fit_sums
from integrations.rl.conventions import ADVANTAGES, INPUT_IDS, LOSS_MASK, PREV_LOGPROBS, RETURNS, REWARD, VALUES
from integrations.rl.metering import TrafficMeter
from integrations.rl.split_step import TrainStepError
from integrations.rl.workers.base import RLWorkerMixin
from integrations.rl.workers.build import ParallelStates, WorkerFactory, check_factories, check_worker
from integrations.rl.workers.layout import RankLayout

__all__ = [
    "ChunkReport",
    "ParamDigest",
    "StepClock",
    "TrainerActor",
    "WorkerFactory",
    "param_digest",
    "row_fingerprint",
]

_F = TypeVar("_F", bound=Callable[..., Any])


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

    >>> param_digest({"w": torch.tensor([3.0, 4.0])}).norm  # exact on any CPU (sqrt of 25)
    5.0
    """
    h = hashlib.sha256()
    sq = torch.zeros((), dtype=torch.float64)
    for t in params.values():
        flat = t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
        h.update(flat.numpy().tobytes())
        sq += flat.double().square().sum()
    return ParamDigest(sha256=h.hexdigest(), norm=float(sq.sqrt()))


class StepClock:
    """Where one rank's step calls spend their time: moving data against everything else.

    ``call()`` times a step call (the outermost one when calls nest: ``train`` runs ``begin``,
    ``train_chunk``, ``finish``); ``data()`` times a data movement inside it (a nested one counts once;
    one outside any call is not counted, so ``compute = calls - data`` is never negative). With
    ``cuda`` set, every reading synchronizes the current device first, so queued kernels count where
    they ran and not at the next synchronizing call.

    >>> clock = StepClock()
    >>> with clock.call():
    ...     with clock.data():
    ...         pass
    >>> sorted(clock.totals())
    ['trainer_compute_seconds', 'trainer_data_seconds']
    >>> all(v >= 0 for v in clock.totals().values())
    True
    """

    def __init__(self, *, cuda: bool = False) -> None:
        self.cuda = cuda
        self.call_s = 0.0
        self.data_s = 0.0
        self._calls = 0
        self._data = 0
        self._pending = 0.0  # data time of the open call: kept when it returns, dropped when it raises

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Time a step call (an exception leaves the totals as they were before it)."""
        outer = self._calls == 0
        if outer:
            self._pending = 0.0
        t0 = self._now() if outer else 0.0
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1
        if outer:
            self.call_s += self._now() - t0
            self.data_s += self._pending

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """Time a data movement inside a call."""
        counted = self._calls > 0 and self._data == 0
        t0 = self._now() if counted else 0.0
        self._data += 1
        try:
            yield
        finally:
            self._data -= 1
        if counted:
            self._pending += self._now() - t0

    def timed_data(self, fn: _F) -> _F:
        """``fn`` with every call timed by :meth:`data`."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.data():
                return fn(*args, **kwargs)

        return timed  # type: ignore[return-value]

    def reset(self) -> None:
        """Start the totals over."""
        self.call_s = 0.0
        self.data_s = 0.0

    def totals(self) -> dict[str, float]:
        """``trainer_data_seconds`` (moving data) and ``trainer_compute_seconds`` (the rest of the calls)."""
        return {"trainer_data_seconds": self.data_s, "trainer_compute_seconds": max(0.0, self.call_s - self.data_s)}


def _step_call(method: _F) -> _F:
    """A :class:`TrainerActor` method whose time counts in the rank's :class:`StepClock`."""

    @functools.wraps(method)
    def timed(self: TrainerActor, *args: Any, **kwargs: Any) -> Any:
        with self.clock.call():
            return method(self, *args, **kwargs)

    return timed  # type: ignore[return-value]


class TrainerActor:
    """One rank of a training group; see the module docstring. Methods other than :meth:`node_address`,
    :meth:`free_port`, :meth:`traffic`, :meth:`describe` and :meth:`version` are collectives: call them
    on every rank.

    Args:
        rank, world: this rank and the group size.
        tp, pp: the group's tensor- and pipeline-parallel sizes (DP = world / (tp * pp); the layout is
            :class:`~integrations.rl.workers.layout.RankLayout`'s): what a worker class's
            ``setup_parallel_state`` gets (Megatron's groups); FSDP2 workers take their TP from their factory.
        threads: torch intra-op threads (1 suits many ranks per host; more for one rank per host).
        deterministic: use deterministic kernels where torch has them
            (``torch.use_deterministic_algorithms(True, warn_only=True)``, uninitialised memory left as
            it is, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set): on GPUs, where some kernels
            accumulate in a varying order, two runs then end with the same bits. Set before any
            CUDA work of the process.
    """

    def __init__(
        self, rank: int, world: int, *, tp: int = 1, pp: int = 1, threads: int = 1, deterministic: bool = False
    ) -> None:
        check_int("rank", rank, low=0, high=world - 1, allow_numpy=True)
        self.rank, self.world = rank, world
        self.layout = RankLayout.for_world(world, tp=tp, pp=pp)
        torch.set_num_threads(threads)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
        # Gathering TP x FSDP parameters for a weight sync takes two all-gathers, and torch warns each time.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.workers: dict[str, RLWorkerMixin] = {}
        self.parallel_states = ParallelStates()
        self.meter = TrafficMeter()
        self.clock = StepClock()
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
        """Join the group (``tcp://address:port``, rank 0 serves it); returns this process id.

        With NCCL (``"nccl"``, or a ``"cpu:gloo,cuda:nccl"`` pair) the rank first makes its CUDA device
        current (see the module docstring): NCCL needs one device per rank of a host.
        """
        if "nccl" in backend:
            torch.cuda.set_device(self._cuda_index())
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                init_method=f"tcp://{address}:{port}",
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(seconds=timeout_s),
            )
        return os.getpid()

    def _cuda_index(self) -> int:
        count = torch.cuda.device_count()
        if count < 1:
            raise InvalidArgument(
                f"rank {self.rank}: backend nccl, but this process sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); give each trainer actor "
                "num_gpus=1, or use gloo"
            )
        return 0 if count == 1 else self.rank % count

    def describe(self) -> dict[str, Any]:
        """This rank: its process-group backend, layout, workers (their classes) and parallel states set
        up, the policy's compute device and, on CUDA, the GPU."""
        out: dict[str, Any] = {
            "rank": self.rank,
            "pid": os.getpid(),
            "backend": str(dist.get_backend()) if dist.is_initialized() else None,
            "layout": self.layout.to_dict(),
            "workers": {name: type(w).__name__ for name, w in self.workers.items()},
            "parallel_states": self.parallel_states.classes,
            "device": str(self.workers["policy"].compute_device()) if "policy" in self.workers else None,
        }
        if out["device"] is not None and out["device"].startswith("cuda"):
            out["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
            out["gpu"] = torch.cuda.get_device_name()
            out["gpu_uuid"] = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", ""))
        return out

    def build(self, factories: Mapping[str, WorkerFactory]) -> None:
        """(Re)build the named workers (a collective): ``{"policy": factory, "reference": factory}``.

        Each factory builds an :class:`~integrations.rl.workers.RLWorkerMixin` (anything else:
        :class:`~dataplane.InvalidArgument`, before any model is built where the factory tells its class).
        The old workers are dropped and the parallel state they needed torn down; then each worker
        class's ``setup_parallel_state`` runs once with this group's layout (Megatron's
        ``parallel_state``), then the factories. Every rank passes the same factories (the same seeds),
        so all start from the same weights. A rebuilt worker starts at version 0 with fresh optimizer
        state, and the rank's traffic and step-call totals (:meth:`traffic`) start over: a run on a
        rebuilt cluster reports its own.
        """
        classes = check_factories(factories)
        for worker in self.workers.values():
            worker.close_data_plane()
        self.workers, self._losses = {}, {}
        self.parallel_states.teardown()
        self.parallel_states.setup(list(classes.values()), self.layout)
        for name, factory in factories.items():
            self.workers[name] = check_worker(name, factory())
        for worker in self.workers.values():
            self._time_data_movement(worker)
        self.clock.cuda = any(w.compute_device().type == "cuda" for w in self.workers.values())
        self.clock.reset()
        self.meter.reset()
        self._attach()

    def _time_data_movement(self, worker: RLWorkerMixin) -> None:
        """Count the worker's reads (``fetch_agreed``: the read, a replica group's broadcast, the copy to the
        device, the agreement) and write-backs in :attr:`clock` as data time: the instance's own methods
        are wrapped, so its inner calls (``get_logprobs_presharded`` fetches and writes back) count too."""
        for name in ("fetch_agreed", "write_back"):
            try:
                setattr(worker, name, self.clock.timed_data(getattr(worker, name)))
            except AttributeError:  # a worker with __slots__: its reads count as compute
                pass

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
    def _worker(self, model: str) -> RLWorkerMixin:
        try:
            return self.workers[model]
        except KeyError:
            raise InvalidArgument(f"no worker {model!r} here (built: {sorted(self.workers)}); build() it") from None

    def _local(self, worker: RLWorkerMixin, data: TensorDictBase) -> TensorDictBase:
        with self.clock.data():  # rows shipped with the call (or already fetched there): to the compute device
            return data.to(worker.compute_device())

    @_step_call
    def logprobs(
        self, model: str, shard: KVBatchMeta, out_field: str = PREV_LOGPROBS, data: TensorDictBase | None = None
    ) -> KVBatchMeta | Tensor | None:
        """Token-aligned logprobs of the shard's rows under ``model``.

        Without ``data``: read ``input_ids`` from the data plane and write ``out_field`` back from the
        replica leader; returns the written meta there, None on its siblings. With ``data`` (the
        shard's padded tensors): return ``[rows, width]`` float32 on the replica leader, None elsewhere.
        """
        return self._forward("logprobs", model, shard, out_field, data)

    @_step_call
    def values(
        self, model: str, shard: KVBatchMeta, out_field: str = VALUES, data: TensorDictBase | None = None
    ) -> KVBatchMeta | Tensor | None:
        """Token-aligned values ``V(s_t)`` of the shard's rows under the value model ``model``; written
        back or returned like :meth:`logprobs`."""
        return self._forward("values", model, shard, out_field, data)

    def _forward(
        self,
        kind: Literal["logprobs", "values"],
        model: str,
        shard: KVBatchMeta,
        out_field: str,
        data: TensorDictBase | None,
    ) -> KVBatchMeta | Tensor | None:
        """:meth:`logprobs` or :meth:`values` (``kind``): written back from the data plane's rows, or
        computed on ``data`` and returned by the replica leader."""
        worker = self._worker(model)
        if data is None:
            write = worker.get_logprobs_presharded if kind == "logprobs" else worker.get_values_presharded
            return write(shard, out_field)
        forward = worker.forward_logprobs if kind == "logprobs" else worker.forward_values
        out = forward(self._local(worker, data), shard)
        return out if worker.is_writeback_leader() else None

    @_step_call
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

    @_step_call
    def begin(self, loss_fn: Any, model: str = "policy") -> None:
        """Open a train step of ``model`` with ``loss_fn``."""
        self._worker(model).begin_train_step(loss_fn)
        self._losses[model] = loss_fn

    @_step_call
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

    @_step_call
    def finish(self, model: str = "policy") -> dict[str, float]:
        """Finish the open step (normalise, clip, step); its metrics, the same on every rank."""
        return self._worker(model).finish_train_step()

    def abort(self, model: str | None = "policy") -> None:
        """Drop ``model``'s open step (None: every model's), if any (idempotent): parameters, optimizer
        state and version untouched."""
        for worker in self.workers.values() if model is None else [self._worker(model)]:
            worker.abort_train_step()

    @_step_call
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
        """Whole parameters on the CPU under the rollout model's names (a collective: the worker's
        ``export_weights()``, which gathers TP / FSDP / PP shards): rank 0 puts them in Ray's object store
        and returns the ref (a weight sync hands it to the rollout actor; the driver never holds the
        tensors), the others None."""
        import ray

        params = self._worker(model).export_weights()
        return ray.put(params) if self.rank == 0 else None

    def save_state(self, path: str) -> None:
        """Save every model's state under ``path/<model>`` (a collective: every rank, the same path;
        see :mod:`integrations.rl.checkpoint`)."""
        from integrations.rl.checkpoint import save_worker_state

        for name, worker in self.workers.items():
            save_worker_state(worker, os.path.join(path, name), rank=self.rank)

    def load_state(self, path: str) -> dict[str, int]:
        """Load every model's state saved by :meth:`save_state` (a collective); returns each model's version."""
        from integrations.rl.checkpoint import load_worker_state

        for name, worker in self.workers.items():
            load_worker_state(worker, os.path.join(path, name), rank=self.rank)
        return {name: int(w.weight_version) for name, w in self.workers.items()}

    def param_digest(self, model: str = "policy") -> ParamDigest:
        """:func:`param_digest` of the whole parameters as :meth:`state_dict_ref` sends them (a collective;
        the same on every rank)."""
        return param_digest(self._worker(model).export_weights())

    def traffic(self) -> dict[str, float]:
        """This process's data-plane totals (:meth:`~integrations.rl.metering.TrafficMeter.totals`) and its
        step calls' time so far (:meth:`StepClock.totals`)."""
        return {**self.meter.totals(), **self.clock.totals()}
