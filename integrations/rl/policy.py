"""The driver's handle on a group of trainer actors: shard once, fan out, collect, keep the caller's order.

A :class:`Policy` wraps one :class:`~integrations.rl.trainer_actor.TrainerActor` per rank (Ray
actors in one ``torch.distributed`` group, ranks laid out ``dp x tp x pp`` the way Megatron orders
them: rank ``r`` is DP rank ``(r // tp) % dp``; see :class:`~integrations.rl.workers.layout.RankLayout`).
The workers are any :class:`~integrations.rl.workers.RLWorkerMixin` (FSDP2, Hugging Face, Megatron,
your own), built from factories on every rank. Every call

* splits the caller's meta with :func:`dataplane.preshard.shard_meta_for_dp` **once**, on the driver:
  balanced tokens, the same number of microbatches on every DP rank, one global pad length;
* sends DP shard ``d`` to every rank of DP rank ``d`` (its TP and PP siblings get the same shard);
* collects per-rank results with a timeout, keeps the replica leaders' (siblings' would be
  duplicates) and puts per-row results back into the caller's row order
  (:func:`dataplane.preshard.restore_order`).

Rows travel through the data plane: the driver sends metas and gets metas and metrics back. For a
comparison with trainers that have no data plane, the same calls take ``data=`` (the batch's padded
tensors, in the meta's row order): the driver then cuts each rank's rows out of it and ships them
with the call (Ray object refs), and logprobs come back as tensors.

Failures: an error a rank raises (the same typed error on every rank, for a failed read) is raised
here as is. A rank that dies, or a group that does not answer within ``timeout_s``, raises
:class:`ActorFailure` / :class:`ActorTimeout`; the other ranks would wait forever in collectives the
lost rank never joins, so the handle kills the whole group first. Spawn a new one to go on.

Ray is imported only where a call needs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from dataplane import DataPlaneError, DataPlaneTimeout, InvalidArgument, KVBatchMeta
from dataplane.checks import check_int, check_number
from dataplane.preshard import restore_order, shard_meta_for_dp
from integrations.rl.conventions import ADVANTAGES, INPUT_IDS, PREV_LOGPROBS, RETURNS, VALUES
from integrations.rl.split_step import TrainStepError
from integrations.rl.trainer_actor import ChunkReport, ParamDigest, TrainerActor
from integrations.rl.workers.base import RLWorkerMixin
from integrations.rl.workers.build import WorkerFactory, check_factories
from integrations.rl.workers.layout import RankLayout

__all__ = ["ActorFailure", "ActorTimeout", "ChunkResult", "Policy", "TrainResult", "gather", "shard_tensors"]


class ActorFailure(DataPlaneError, RuntimeError):
    """An actor died, or a group of actors was left stuck by a failed member; the group was shut down."""


class ActorTimeout(ActorFailure, DataPlaneTimeout):
    """Actors did not answer within their timeout; the group was shut down."""


def gather(
    refs: Sequence[Any],
    *,
    timeout_s: float,
    what: str,
    names: Sequence[str] | None = None,
    grace_s: float = 10.0,
    on_broken: Callable[[], None] | None = None,
) -> list[Any]:
    """``ray.get`` of ``refs`` that never waits past ``timeout_s`` and names who failed.

    * a task that raised: the others get ``grace_s`` more to finish (a failure every rank agreed on
      ends them all at once); then the error is raised as the task raised it (its class, typed);
    * an actor that died, or tasks still running at the deadline (or after a failure's grace):
      ``on_broken()`` (shut the group down), then :class:`ActorFailure` / :class:`ActorTimeout`.

    Args:
        refs: object refs of one call fanned out to a group.
        timeout_s: the most this waits in all.
        what: the call, for messages.
        names: one name per ref (default ``rank i``).
        grace_s: how long the others may still take after one failed.
        on_broken: called before raising for a dead or stuck group.
    """
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    labels = list(names) if names is not None else [f"rank {i}" for i in range(len(refs))]
    index = {ref: i for i, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    failed: tuple[int, BaseException] | None = None
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left, fetch_local=False)
        for ref in ready:
            try:
                ray.get(ref, timeout=max(left, 1.0))
            except RayActorError as e:
                if on_broken is not None:
                    on_broken()
                raise ActorFailure(
                    f"{what}: {labels[index[ref]]} died ({type(e).__name__}); the group was shut down "
                    "(its other members would wait forever for it): start a new one"
                ) from e
            except RayTaskError as e:
                if failed is None:
                    failed = (index[ref], e.cause if isinstance(e.cause, BaseException) else e)
                    deadline = min(deadline, time.monotonic() + grace_s)
    if pending:
        stuck = [labels[index[r]] for r in pending]
        if on_broken is not None:
            on_broken()
        if failed is not None:
            who, cause = failed
            raise ActorFailure(
                f"{what}: {labels[who]} raised {type(cause).__name__}: {cause}; {', '.join(stuck)} did not finish "
                f"within {grace_s:g} s after it (stuck in a collective it never joined): the group was shut down"
            ) from cause
        raise ActorTimeout(
            f"{what}: {', '.join(stuck)} did not answer within {timeout_s:g} s; the group was shut down. "
            "Raise timeout_s if the work is just slow"
        )
    if failed is not None:
        raise failed[1]
    return [ray.get(r) for r in refs]


def shard_tensors(data: TensorDictBase, shard: KVBatchMeta, fields: Sequence[str] | None = None) -> TensorDict:
    """The rows of ``shard`` cut out of ``data`` (the whole batch, in the sharded meta's row order), as
    a data-plane read of the shard gives them: ``[rows, pad_to_length]`` for token fields (zeros past
    the batch's width), per-row fields as they are.

    >>> m = KVBatchMeta(partition_id="p", keys=["a", "b", "c"], sequence_lengths=[1, 3, 2])
    >>> data = TensorDict({"input_ids": torch.tensor([[1, 0, 0], [1, 2, 3], [1, 2, 0]])}, batch_size=[3])
    >>> shards = shard_meta_for_dp(m, 2)
    >>> [shard_tensors(data, s)["input_ids"].tolist() for s in shards]
    [[[1, 0, 0], [1, 2, 0]], [[1, 2, 3]]]
    """
    rows = shard.extra_info.get("original_indices")
    if rows is None:
        raise InvalidArgument("shard has no extra_info['original_indices']; pass a meta shard_meta_for_dp made")
    width = shard.extra_info.get("pad_to_length")
    idx = torch.tensor([int(i) for i in rows], dtype=torch.int64)
    out: dict[str, Tensor] = {}
    for name in fields if fields is not None else list(data.keys()):
        value = data.get(name)
        part = value[idx]
        if part.dim() >= 2 and width is not None:
            have = int(part.shape[1])
            if have >= width:
                part = part[:, :width]
            else:
                part = torch.cat([part, part.new_zeros((part.shape[0], width - have, *part.shape[2:]))], dim=1)
        out[name] = part.contiguous()
    return TensorDict(out, batch_size=[len(idx)])


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """What a chunk trained: the DP shards the driver made, and each DP rank's report (its leader's)."""

    shards: list[KVBatchMeta]
    reports: list[ChunkReport]


@dataclass(frozen=True, slots=True)
class TrainResult:
    """A whole step: the step's metrics (the same on every rank; the leader's kept), the chunk, the version."""

    metrics: dict[str, float]
    chunk: ChunkResult
    version: int


class Policy:
    """A driver-side handle on ``dp * tp * pp`` trainer actors; see the module docstring.

    Args:
        actors: one :class:`~integrations.rl.trainer_actor.TrainerActor` handle per rank, in rank order.
        dp, tp, pp: the layout (``len(actors) == dp * tp * pp``; rank ``r`` is DP rank ``(r // tp) % dp``,
            and DP rank ``d``'s leader, which writes back, is rank ``d * tp``).
        timeout_s: the most any call waits for the group.
        max_tokens_per_microbatch: token budget of each planned microbatch (None: the whole shard at
            once); the plan travels in the shards, so every DP rank runs the same number.
        equal_rows: give every DP rank the same number of rows (when the batch divides).
    """

    def __init__(
        self,
        actors: Sequence[Any],
        *,
        dp: int,
        tp: int = 1,
        pp: int = 1,
        timeout_s: float = 300.0,
        max_tokens_per_microbatch: int | None = None,
        equal_rows: bool = False,
    ) -> None:
        for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
            check_int(name, value, low=1)
        self.layout = RankLayout(dp=dp, tp=tp, pp=pp)
        if len(actors) != self.layout.world:
            raise InvalidArgument(f"{len(actors)} actors for dp={dp} x tp={tp} x pp={pp}; give one actor per rank")
        check_number("timeout_s", timeout_s, low=0, low_open=True)
        self.actors = list(actors)
        self.dp, self.tp, self.pp = dp, tp, pp
        self.timeout_s = float(timeout_s)
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.equal_rows = equal_rows
        self.versions: dict[str, int] = {}  # model -> finished steps
        self._open: dict[str, Any] = {}  # model -> the loss of its open step
        self._broken: str | None = None

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def spawn(
        cls,
        factories: Mapping[str, WorkerFactory],
        *,
        dp: int,
        tp: int = 1,
        pp: int = 1,
        url: str | None = None,
        num_cpus: float = 0.5,
        num_gpus: float = 0,
        threads: int = 1,
        deterministic: bool = False,
        backend: str = "gloo",
        runtime_env: Mapping[str, Any] | None = None,
        timeout_s: float = 300.0,
        pg_timeout_s: float = 300.0,
        **options: Any,
    ) -> Policy:
        """Start ``dp * tp * pp`` trainer actors, join them in one process group, build ``factories`` on each
        (``{"policy": ..., "reference": ...}``, picklable callables building an
        :class:`~integrations.rl.workers.RLWorkerMixin`) and connect them to ``url``.

        A factory whose class is known here (a class, a ``functools.partial`` of one) and is not a worker
        is refused before any actor starts (:class:`~dataplane.InvalidArgument`; see
        :mod:`integrations.rl.workers.build`).

        Args:
            dp, tp, pp: the layout (see :class:`Policy`); Megatron workers get their groups from it.
            num_cpus, num_gpus, runtime_env: each actor's Ray resources and environment (on GPUs:
                ``num_gpus=1``, ``backend="nccl"``, factories building on ``"cuda"``).
            threads: torch threads per actor.
            deterministic: deterministic kernels on every rank (see
                :class:`~integrations.rl.trainer_actor.TrainerActor`; for bit-identical runs on GPUs).
            pg_timeout_s: the process group's own timeout (a collective waits at most this long).
            options: more :class:`Policy` arguments (``max_tokens_per_microbatch``, ``equal_rows``).
        """
        import ray

        check_factories(factories)
        world = RankLayout(dp=dp, tp=tp, pp=pp).world
        remote_cls = ray.remote(TrainerActor)
        opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if runtime_env is not None:
            opts["runtime_env"] = dict(runtime_env)
        actors = [
            remote_cls.options(**opts).remote(r, world, tp=tp, pp=pp, threads=threads, deterministic=deterministic)
            for r in range(world)
        ]
        policy = cls(actors, dp=dp, tp=tp, pp=pp, timeout_s=timeout_s, **options)
        first = actors[0]
        try:
            address, port = policy._gather(
                [first.node_address.remote(), first.free_port.remote()],  # type: ignore[attr-defined]
                "rendezvous",
            )
        except ActorTimeout as e:
            raise ActorTimeout(
                f"{e}. An actor that never starts usually waits for resources: {world} actors x num_cpus={num_cpus}"
                f" (num_gpus={num_gpus}) must fit Ray's free resources ({ray.available_resources()})"  # type: ignore[no-untyped-call]
            ) from e
        try:
            policy._all(
                "init_process_group",
                lambda r, a: a.init_process_group.remote(address, port, backend=backend, timeout_s=pg_timeout_s),
            )
            policy.build(factories)
            if url is not None:
                policy.connect(url)
        except BaseException as e:  # a group that did not come up is of no use: stop its actors
            policy.shutdown(f"spawn failed: {type(e).__name__}")
            raise
        return policy

    def build(self, factories: Mapping[str, WorkerFactory]) -> None:
        """(Re)build every rank's workers from ``factories``: fresh weights, optimizer state, version 0
        (the parallel state the old workers needed is torn down and set up again)."""
        check_factories(factories)
        if self._open:
            raise TrainStepError(
                f"build() with train steps of {sorted(self._open)} open; finish() or abort() them first"
            )
        self._all("build", lambda r, a: a.build.remote(dict(factories)))
        self.versions = {}

    def connect(self, url: str | None) -> None:
        """Point every rank at the data plane ``url`` (a ``client.url``), or at none (inline only)."""
        self._all("connect", lambda r, a: a.connect.remote(url))

    # -- plumbing ------------------------------------------------------------------------------------
    def _gather(self, refs: Sequence[Any], what: str) -> list[Any]:
        if self._broken is not None:
            raise ActorFailure(f"{what}: this group was shut down ({self._broken}); spawn a new one")
        return gather(refs, timeout_s=self.timeout_s, what=what, on_broken=lambda: self.shutdown(f"{what} failed"))

    def _all(self, what: str, call: Callable[[int, Any], Any]) -> list[Any]:
        if self._broken is not None:
            raise ActorFailure(f"{what}: this group was shut down ({self._broken}); spawn a new one")
        return self._gather([call(r, a) for r, a in enumerate(self.actors)], what)

    @property
    def version(self) -> int:
        """Finished steps of the ``"policy"`` model (``versions`` has every model's)."""
        return self.versions.get("policy", 0)

    def _require_closed(self, what: str, model: str) -> None:
        if model in self._open:
            raise TrainStepError(f"{what}() with a train step of {model!r} open; finish() or abort() it first")

    def _require_open(self, what: str, model: str) -> Any:
        if model not in self._open:
            raise TrainStepError(
                f"{what}() needs an open step of {model!r}; call begin(loss_fn, model={model!r}) first"
            )
        return self._open[model]

    def shard(self, meta: KVBatchMeta) -> list[KVBatchMeta]:
        """The DP shards of ``meta`` (one per DP rank), as every call here makes them."""
        if not isinstance(meta, KVBatchMeta):
            raise InvalidArgument(f"expected a KVBatchMeta, got {type(meta).__name__}")
        return shard_meta_for_dp(
            meta, self.dp, max_tokens_per_microbatch=self.max_tokens_per_microbatch, equal_rows=self.equal_rows
        )

    def _payloads(self, data: TensorDictBase | None, shards: list[KVBatchMeta], fields: Sequence[str]) -> list[Any]:
        """Per DP rank: None (read from the data plane) or an object ref of its rows (TP siblings share it)."""
        if data is None:
            return [None] * self.dp
        import ray

        if not isinstance(data, TensorDictBase):
            raise InvalidArgument(f"data must be a TensorDict of the batch's rows, got {type(data).__name__}")
        rows = sum(s.size for s in shards)
        if data.batch_size[0] != rows:
            raise InvalidArgument(f"data has {data.batch_size[0]} rows, the meta {rows}; give one row per key")
        missing = [f for f in fields if f not in data.keys()]
        if missing:
            raise InvalidArgument(f"data lacks fields {missing}; it has {sorted(data.keys())}")
        return [ray.put(shard_tensors(data, s, fields)) for s in shards]

    def _dp(self, rank: int) -> int:
        """The DP rank of ``rank`` (which shard it gets)."""
        return self.layout.dp_rank(rank)

    def _leaders(self, per_rank: list[Any]) -> list[Any]:
        return [per_rank[r] for r in self.layout.leaders()]

    # -- calls -----------------------------------------------------------------------------------------
    def logprobs(
        self,
        meta: KVBatchMeta,
        out_field: str = PREV_LOGPROBS,
        *,
        model: str = "policy",
        data: TensorDictBase | None = None,
    ) -> KVBatchMeta | Tensor:
        """Token-aligned logprobs of ``meta``'s rows under ``model`` (``"policy"``, ``"reference"``, ...).

        Returns:
            without ``data``: ``meta`` with ``out_field`` added (the replica leaders wrote it);
            with ``data``: a ``[rows, pad_to_length]`` float32 tensor in ``meta``'s row order.
        """
        return self._forward("logprobs", meta, out_field, model, data)

    def values(
        self,
        meta: KVBatchMeta,
        out_field: str = VALUES,
        *,
        model: str = "value",
        data: TensorDictBase | None = None,
    ) -> KVBatchMeta | Tensor:
        """Token-aligned values ``V(s_t)`` of ``meta``'s rows under the value model ``model``; returns
        like :meth:`logprobs`."""
        return self._forward("values", meta, out_field, model, data)

    def _forward(
        self, kind: str, meta: KVBatchMeta, out_field: str, model: str, data: TensorDictBase | None
    ) -> KVBatchMeta | Tensor:
        shards = self.shard(meta)
        payloads = self._payloads(data, shards, [INPUT_IDS])
        out = self._leaders(
            self._all(
                f"{kind}({model})",
                lambda r, a: getattr(a, kind).remote(model, shards[self._dp(r)], out_field, payloads[self._dp(r)]),
            )
        )
        if data is not None:
            return restore_order(out, shards)  # type: ignore[no-any-return]
        _check_written(f"{kind}({model})", out, shards)
        return meta.with_fields([out_field])

    def sequence_gae(
        self, meta: KVBatchMeta, *, gamma: float, lam: float, model: str = "value"
    ) -> tuple[KVBatchMeta, dict[str, float]]:
        """PPO's advantage stage on the trainers: each DP shard's leader reads ``values``, ``loss_mask``
        and ``reward``, runs :func:`~integrations.rl.advantages.sequence_gae` and writes ``advantages``
        and ``returns`` back. Returns ``meta`` with both fields and the batch's
        :func:`~integrations.rl.advantages.value_fit_sums`."""
        shards = self.shard(meta)
        out = self._leaders(
            self._all(
                f"sequence_gae({model})", lambda r, a: a.sequence_gae.remote(shards[self._dp(r)], gamma, lam, model)
            )
        )
        _check_written("sequence_gae", [written for written, _ in out], shards)
        sums: dict[str, float] = {}
        for _, part in out:
            for k, v in part.items():
                sums[k] = sums.get(k, 0.0) + v
        return meta.with_fields([ADVANTAGES, RETURNS]), sums

    def train(
        self, meta: KVBatchMeta, loss_fn: Any, *, data: TensorDictBase | None = None, model: str = "policy"
    ) -> TrainResult:
        """One whole optimizer step of ``model`` on ``meta``'s rows (``begin``, all planned
        microbatches, ``finish`` in one call per rank)."""
        self._require_closed("train", model)
        shards = self.shard(meta)
        payloads = self._payloads(data, shards, RLWorkerMixin.train_fields(loss_fn))
        out = self._all(
            f"train({model})", lambda r, a: a.train.remote(shards[self._dp(r)], loss_fn, payloads[self._dp(r)], model)
        )
        self.versions[model] = self.versions.get(model, 0) + 1
        leaders = self._leaders(out)
        return TrainResult(
            metrics=leaders[0][1], chunk=ChunkResult(shards, [rep for rep, _ in leaders]), version=self.versions[model]
        )

    def begin(self, loss_fn: Any, *, model: str = "policy") -> None:
        """Open a split step of ``model`` on every rank (one open step per model at a time)."""
        self._require_closed("begin", model)
        self._all(f"begin({model})", lambda r, a: a.begin.remote(loss_fn, model))
        self._open[model] = loss_fn

    def train_chunk(
        self, meta: KVBatchMeta, *, data: TensorDictBase | None = None, model: str = "policy"
    ) -> ChunkResult:
        """Train ``meta``'s rows into ``model``'s open step (sharded on their own: a chunk is a small batch)."""
        loss_fn = self._require_open("train_chunk", model)
        shards = self.shard(meta)
        payloads = self._payloads(data, shards, RLWorkerMixin.train_fields(loss_fn))
        out = self._all(
            f"train_chunk({model})",
            lambda r, a: a.train_chunk.remote(shards[self._dp(r)], payloads[self._dp(r)], model),
        )
        return ChunkResult(shards, self._leaders(out))

    def finish(self, *, model: str = "policy") -> dict[str, float]:
        """Finish ``model``'s open step on every rank; its metrics (the leader's: every rank has the same)."""
        self._require_open("finish", model)
        out = self._all(f"finish({model})", lambda r, a: a.finish.remote(model))
        del self._open[model]
        self.versions[model] = self.versions.get(model, 0) + 1
        return out[0]  # type: ignore[no-any-return]

    def abort(self, *, model: str | None = None) -> None:
        """Drop ``model``'s open step (None: every open step) on every rank (idempotent); no version moves."""
        if model is None:
            self._open.clear()
        else:
            self._open.pop(model, None)
        if self._broken is None:
            self._all(f"abort({model or 'all'})", lambda r, a: a.abort.remote(model))

    # -- weights -------------------------------------------------------------------------------------
    def state_dict_ref(self, model: str = "policy") -> Any:
        """An object ref of ``model``'s whole parameters (rank 0 gathers them; the driver never holds
        them): pass it to another actor's call, which receives the dict."""
        return self._all("state_dict_ref", lambda r, a: a.state_dict_ref.remote(model))[0]

    def save_checkpoint(self, path: str) -> None:
        """Save every model's weights, optimizer, schedule, version and each rank's RNG under ``path``
        (every rank writes its own shards; :mod:`integrations.rl.checkpoint`). No step may be open."""
        for model in self._open:
            self._require_closed("save_checkpoint", model)
        self._all("save_checkpoint", lambda r, a: a.save_state.remote(path))

    def load_checkpoint(self, path: str) -> None:
        """Load what :meth:`save_checkpoint` saved into this group's models (built with the same
        factories and layout); the versions come back with it."""
        for model in self._open:
            self._require_closed("load_checkpoint", model)
        versions = self._all("load_checkpoint", lambda r, a: a.load_state.remote(path))[0]
        self.versions = dict(versions)

    def param_digest(self, model: str = "policy") -> ParamDigest:
        """sha256 and norm of ``model``'s whole parameters (:func:`~integrations.rl.trainer_actor.param_digest`)."""
        return self._all("param_digest", lambda r, a: a.param_digest.remote(model))[0]  # type: ignore[no-any-return]

    def traffic(self) -> list[dict[str, float]]:
        """Each rank's data-plane totals and step-call times (:meth:`~integrations.rl.trainer_actor.TrainerActor.traffic`)."""
        return self._all("traffic", lambda r, a: a.traffic.remote())

    def describe(self) -> list[dict[str, Any]]:
        """Each rank's backend and devices (:meth:`~integrations.rl.trainer_actor.TrainerActor.describe`)."""
        return self._all("describe", lambda r, a: a.describe.remote())

    # -- teardown ------------------------------------------------------------------------------------
    @property
    def broken(self) -> str | None:
        """Why the group was shut down, or None while it is usable."""
        return self._broken

    def shutdown(self, reason: str = "shut down") -> None:
        """Kill every actor of the group (idempotent). The handle refuses calls afterwards."""
        import ray

        if self._broken is None:
            self._broken = reason
        self._open = {}
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass


def _check_written(what: str, written: Sequence[Any], shards: Sequence[KVBatchMeta]) -> None:
    """Every DP rank's leader returned the meta of its shard (rows written back); an empty shard may
    return anything."""
    for d, (meta, shard) in enumerate(zip(written, shards, strict=True)):
        if shard.size and (not isinstance(meta, KVBatchMeta) or meta.keys != shard.keys):
            raise DataPlaneError(f"{what}: DP rank {d}'s leader wrote no meta for its shard")
