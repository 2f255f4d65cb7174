"""The presharded entry points every RL worker shares, whatever parallelises its model.

:class:`RLWorkerMixin` turns a shard meta (:func:`dataplane.preshard.shard_meta_for_dp`) into a
train step or a forward whose results go back to the data plane:

* :meth:`~RLWorkerMixin.train_presharded` (begin, every planned microbatch, finish) and its parts
  :meth:`~RLWorkerMixin.train_microbatches_presharded` / :meth:`~RLWorkerMixin.train_microbatches`;
* :meth:`~RLWorkerMixin.get_logprobs_presharded` / :meth:`~RLWorkerMixin.get_values_presharded`
  (written back token-aligned from the replica leader only), and their fetch-free halves
  :meth:`~RLWorkerMixin.forward_logprobs` / :meth:`~RLWorkerMixin.forward_values`;
* :meth:`~RLWorkerMixin.fetch_agreed` (a failed read on one rank raises on all of them) and
  :meth:`~RLWorkerMixin.planned_microbatches` (the meta's plan, padded with dummies to the DP maximum).

The FSDP2 / DTensor worker (:class:`~integrations.rl.workers.dtensor.DTensorRLWorkerMixin`) and the
Megatron worker (:class:`~integrations.rl.workers.megatron.MegatronRLWorkerMixin`) are this mixin
plus their replica groups, their forward and, for Megatron, its own split step. A worker for another
stack implements :meth:`~RLWorkerMixin.compute_device`, :meth:`~RLWorkerMixin.policy_logits` /
:meth:`~RLWorkerMixin.value_predictions`, the split step's group hooks
(:meth:`~integrations.rl.split_step.SplitTrainStepMixin.train_dp_group`,
:meth:`~integrations.rl.split_step.SplitTrainStepMixin.train_world_group`) and the data plane's
(:meth:`~dataplane.worker.DataPlaneWorkerMixin.replica_group`,
:meth:`~dataplane.worker.DataPlaneWorkerMixin.is_writeback_leader`).

What the Ray trainer actors need besides (:mod:`integrations.rl.workers.build`): the class hooks
:meth:`~RLWorkerMixin.setup_parallel_state` / :meth:`~RLWorkerMixin.teardown_parallel_state` (the
process groups a stack needs before its models are built; nothing for FSDP2) and
:meth:`~RLWorkerMixin.export_weights` (whole parameters under the rollout model's names, what a
weight sync sends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from dataplane import KVBatchMeta
from dataplane.checks import check_int
from dataplane.worker import DataPlaneWorkerMixin, ErrorInfo, error_from_info, microbatch_plan
from dataplane.worker.collective import comm_device
from integrations.rl.conventions import (
    INPUT_IDS,
    LOSS_MASK,
    PREV_LOGPROBS,
    VALUES,
    shift_to_tokens,
    token_entropy,
    token_logprobs,
)
from integrations.rl.split_step import SplitTrainStepMixin, with_token_share

if TYPE_CHECKING:
    from integrations.rl.workers.layout import RankLayout

__all__ = ["RLWorkerMixin", "eval_mode", "full_parameters", "token_counts"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` and ``torch.no_grad()`` for the block; the training mode is restored after.

    >>> m = nn.Linear(2, 2)
    >>> with eval_mode(m):
    ...     (m.training, torch.is_grad_enabled())
    (False, False)
    >>> m.training
    True
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class RLWorkerMixin(SplitTrainStepMixin, DataPlaneWorkerMixin):
    """Presharded train, logprob and value calls over the data plane; see the module docstring.

    The host sets ``model``, ``optimizer``, optionally ``lr_scheduler`` and ``max_grad_norm``, calls
    :meth:`~dataplane.worker.DataPlaneWorkerMixin.setup_data_plane` on every rank, and implements the
    hooks the module docstring lists (the FSDP2 and Megatron mixins implement them).

    Attributes:
        logprob_temperature: logits are divided by it before the log-softmax (match the sampler's).
        forward_micro_batch_size: rows per forward when a meta carries no microbatch plan (None:
            the whole shard at once).
        train_micro_batch_size: rows per train microbatch when a meta carries no plan.
        value_shift: store ``V(s_t)`` at position t, the output at t-1 shifted right (the convention,
            and what PPO needs). False keeps the output at t where it is (V after seeing token t,
            one token late): the misalignment a PPO port paid ~10 points of reward for, kept only as
            an ablation switch.
        report_entropy: a policy's train step reports ``entropy``, the mean entropy of the
            next-token distributions of its valid tokens (for a token-level loss; a sequence-level
            loss's ``N`` counts rows, so there it is the sum per row).
        forward_metrics: what the last forward-only call (logprobs or values) computed, summed over
            DP: ``num_tokens_real`` (tokens within the rows' lengths), ``num_tokens_computed`` (rows
            times the padded width, dummies included) and ``real_token_share``, their ratio. The
            train step's metrics carry the same three.
    """

    logprob_temperature: float = 1.0
    value_shift: bool = True
    forward_micro_batch_size: int | None = None
    train_micro_batch_size: int | None = None
    report_entropy: bool = False
    forward_metrics: dict[str, float] = {}  # noqa: RUF012 - replaced, never mutated

    # -- the host's model ------------------------------------------------------------------------
    def compute_device(self) -> torch.device:
        """Where fetched batches go for the forward."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_device()")

    def policy_logits(self, input_ids: Tensor) -> Tensor:
        """``input_ids [B, T] -> logits [B, T, V]`` (next-token logits at each position)."""
        raise NotImplementedError(f"{type(self).__name__} must implement policy_logits(input_ids)")

    def value_predictions(self, input_ids: Tensor) -> Tensor:
        """``input_ids [B, T] -> [B, T]``: at position t, the value after seeing tokens ``0..t``."""
        raise NotImplementedError(f"{type(self).__name__} must implement value_predictions(input_ids)")

    def token_logprobs_of(self, input_ids: Tensor) -> Tensor:
        """Token-aligned logprobs ``[B, T]`` of ``input_ids`` (position 0 holds 0)."""
        return token_logprobs(self.policy_logits(input_ids), input_ids, temperature=self.logprob_temperature)

    def token_logprobs_and_entropy(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`token_logprobs_of` and the token-aligned entropy ``[B, T]`` (no gradient) of the
        distributions the tokens were drawn from, from one forward. A worker whose model computes
        log-probs in chunks overrides this and :meth:`token_logprobs_of`."""
        logits = self.policy_logits(input_ids)
        t = self.logprob_temperature
        return token_logprobs(logits, input_ids, temperature=t), token_entropy(logits, temperature=t)

    def token_values_of(self, input_ids: Tensor) -> Tensor:
        """Token-aligned values ``[B, T]``: ``V(s_t)``, predicted before token t (position 0 holds 0)."""
        out = self.value_predictions(input_ids)
        return shift_to_tokens(out) if self.value_shift else out

    # -- what a trainer actor needs besides the calls --------------------------------------------
    @classmethod
    def setup_parallel_state(cls, layout: RankLayout) -> None:
        """Set up on this rank the process groups this worker class's models need, before any is built.

        :class:`~integrations.rl.trainer_actor.TrainerActor` calls it once per build (once per
        distinct hook, however many models use it), after ``init_process_group``, with the group's
        layout. The default does nothing: an FSDP2 worker builds its own device mesh. The Megatron
        mixin initialises ``parallel_state`` with the layout's TP and PP.
        """

    @classmethod
    def teardown_parallel_state(cls) -> None:
        """Undo :meth:`setup_parallel_state`; the actor calls it before a rebuild, after dropping the old models."""

    def export_weights(self) -> dict[str, Tensor]:
        """Every parameter whole, detached, on the CPU, under the name the rollout model loads it by.

        A collective: every rank of the model calls it, and every rank gets the same dict. A weight sync
        sends it (:meth:`~integrations.rl.trainer_actor.TrainerActor.state_dict_ref`) and a parameter
        digest hashes it. The default gathers DTensors
        (:func:`full_parameters`) and keeps the model's own names.
        """
        return full_parameters(self.model)

    # -- split-step hooks ------------------------------------------------------------------------
    def loss_inputs(self, batch: Any, loss_fn: Any) -> Tensor:
        ids = batch[INPUT_IDS]
        if loss_fn.input != "logprobs":
            return self.token_values_of(ids)
        if not self.report_entropy or LOSS_MASK not in batch.keys():
            return self.token_logprobs_of(ids)
        logprobs, entropy = self.token_logprobs_and_entropy(ids)
        self.note_microbatch_metrics(entropy=float((entropy * batch[LOSS_MASK].to(entropy.dtype)).sum()))
        return logprobs

    # -- presharded calls ------------------------------------------------------------------------
    def train_presharded(self, meta: KVBatchMeta, loss_fn: Any) -> dict[str, float]:
        """One whole optimizer step on this rank's shard: begin, every planned microbatch, finish.

        On an exception the step is aborted (parameters and optimizer state untouched) and re-raised.
        """
        self.begin_train_step(loss_fn)
        try:
            self.train_microbatches_presharded(meta)
            return self.finish_train_step()
        except BaseException:
            if self.train_step_open:
                self.abort_train_step()
            raise

    def train_microbatches_presharded(self, meta: KVBatchMeta) -> list[dict[str, float]]:
        """Fetch this shard and train its planned microbatches into the open step (see split_step).

        Call it any number of times between ``begin_train_step`` and ``finish_train_step`` (an
        async trainer trains each ready chunk as it comes). Returns each microbatch's metrics.
        """
        step = self._require_open("train_microbatches_presharded")
        data = self.fetch_agreed(meta, self.train_fields(step.loss_fn))
        return self.train_microbatches(data, meta)

    @staticmethod
    def train_fields(loss_fn: Any) -> list[str]:
        """The fields a train step with ``loss_fn`` reads: ``input_ids`` and the loss's fields (the
        driver's :class:`~integrations.rl.policy.Policy` ships the same ones to trainers without a
        data plane).

        >>> from integrations.rl.losses import ValueLoss
        >>> RLWorkerMixin.train_fields(ValueLoss())
        ['input_ids', 'loss_mask', 'returns']
        """
        return list(dict.fromkeys((INPUT_IDS, *loss_fn.fields)))

    def train_microbatches(self, data: TensorDictBase, meta: KVBatchMeta) -> list[dict[str, float]]:
        """Train this shard's planned microbatches of ``data`` into the open step.

        What :meth:`train_microbatches_presharded` runs after its fetch, for a caller that brings the
        shard itself (a trainer without a data plane): ``data`` holds :meth:`train_fields`, one row per
        row of ``meta``, padded to ``meta.extra_info["pad_to_length"]`` (zeros past each row's length),
        on :meth:`compute_device`. Every rank of the model calls it.
        """
        self._require_open("train_microbatches")
        planned = self.planned_microbatches(data, meta, self.train_micro_batch_size)
        return [
            self.train_microbatch(mb, dummy=not positions, counts=token_counts(mb, positions, meta))
            for positions, mb in planned
        ]

    def get_logprobs_presharded(self, meta: KVBatchMeta, out_field: str = PREV_LOGPROBS) -> KVBatchMeta | None:
        """Write this shard's token-aligned logprobs to ``out_field`` (from the replica leader only).

        Returns:
            the meta with ``out_field`` added on the writing rank, None on its siblings.
        """
        return self._forward_presharded(meta, out_field, self.token_logprobs_of)

    def get_values_presharded(self, meta: KVBatchMeta, out_field: str = VALUES) -> KVBatchMeta | None:
        """Write this shard's token-aligned values ``V(s_t)`` to ``out_field`` (from the leader only)."""
        return self._forward_presharded(meta, out_field, self.token_values_of)

    def fetch_agreed(self, meta: KVBatchMeta, fields: list[str]) -> TensorDictBase:
        """:meth:`~dataplane.worker.DataPlaneWorkerMixin.fetch` (padded), then every rank of the model learns
        whether any failed: if one did, all raise the same typed error (the first failing rank's class and
        message) instead of the others entering a forward whose collectives the failed rank never joins.
        """
        error: BaseException | None = None
        data: Any = None
        try:
            if meta.size:
                data = self.fetch(meta, select_fields=fields, device=self.compute_device())
            else:  # fewer rows than DP ranks: nothing to read, but this rank still runs its peers' forwards
                data = _empty_batch(meta, fields, self.compute_device())
        except Exception as e:
            error = e
        group = self.train_world_group()
        if group is None or dist.get_world_size(group) == 1:
            if error is not None:
                raise error
            return data  # type: ignore[no-any-return]
        me = dist.get_rank()
        first = torch.tensor([me if error is not None else _NO_RANK], dtype=torch.int64, device=comm_device(group))
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        src = int(first.item())
        if src == _NO_RANK:
            return data  # type: ignore[no-any-return]
        box: list[Any] = [ErrorInfo.from_exception(error, me) if error is not None else None]
        dist.broadcast_object_list(box, src=src, group=group)
        raise error_from_info(box[0], context="") from error

    def planned_microbatches(
        self, data: TensorDictBase, meta: KVBatchMeta, micro_batch_size: int | None
    ) -> Iterator[tuple[list[int], TensorDictBase]]:
        """``(row positions, microbatch)`` per the meta's plan, then dummies (no positions) up to the DP maximum.

        Without a plan, consecutive chunks of ``micro_batch_size`` rows (or the whole shard). The
        count is agreed over DP (one small all-reduce), so a rank with fewer microbatches runs
        dummies (:meth:`dummy_microbatch`, empty positions) and every rank joins every collective of
        every forward and backward.
        """
        plan = microbatch_plan(meta)
        if plan is None:
            rows = meta.size
            check_int("micro_batch_size", micro_batch_size, low=1, allow_none=True, allow_numpy=True)
            size = micro_batch_size or rows or 1
            plan = [list(range(s, min(s + size, rows))) for s in range(0, rows, size)]
        count = torch.tensor([len(plan)], dtype=torch.int64)
        group = self.train_dp_group()
        if group is not None and dist.get_world_size(group) > 1:
            count = count.to(comm_device(group))
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        plan = plan + [[] for _ in range(int(count.item()) - len(plan))]
        for positions in plan:
            if not positions:
                yield positions, self.dummy_microbatch(data)
            elif positions == list(range(positions[0], positions[0] + len(positions))):
                yield positions, data[positions[0] : positions[0] + len(positions)]
            else:
                yield positions, data[torch.tensor(positions, dtype=torch.int64)]

    def dummy_microbatch(self, data: TensorDictBase) -> TensorDictBase:
        """One row of zeros shaped like ``data``'s tensor fields (``loss_mask`` 0, so it trains nothing).

        What a rank runs in place of a planned microbatch it has no rows for. One row rather than
        none: a zero-row batch trips DTensor's sharding propagation under tensor parallelism.
        """
        rows = {}
        for k, v in data.items():
            if isinstance(v, Tensor):
                inner = list(v.shape[1:])
                if inner:
                    inner[0] = max(inner[0], 1)  # a rank with no rows and no stamped pad length has width 0
                rows[k] = torch.zeros((1, *inner), dtype=v.dtype, device=v.device)
        return TensorDict(rows, batch_size=[1], device=data.device)

    def forward_logprobs(self, data: TensorDictBase, meta: KVBatchMeta) -> Tensor:
        """Token-aligned logprobs ``[rows, width]`` (float32, CPU) of ``data[INPUT_IDS]``, forwarded in
        ``meta``'s planned microbatches (dummies up to the DP maximum). Every rank of the model calls it.

        What :meth:`get_logprobs_presharded` computes between its fetch and its write-back, for a
        caller that brings the shard itself. Positions past a row's length hold whatever the model
        gives there: mask them before use.
        """
        return self._forward_planned(data, meta, self.token_logprobs_of)

    def forward_values(self, data: TensorDictBase, meta: KVBatchMeta) -> Tensor:
        """Token-aligned values ``[rows, width]`` of ``data[INPUT_IDS]``; see :meth:`forward_logprobs`."""
        return self._forward_planned(data, meta, self.token_values_of)

    def _forward_planned(self, data: TensorDictBase, meta: KVBatchMeta, forward: Any) -> Tensor:
        width = int(data[INPUT_IDS].shape[1]) if meta.size else 0
        result = torch.zeros(meta.size, width, dtype=torch.float32)
        counts = torch.zeros(2, dtype=torch.float64)
        with eval_mode(self.model):
            for positions, mb in self.planned_microbatches(data, meta, self.forward_micro_batch_size):
                out = forward(mb[INPUT_IDS])
                counts += torch.tensor(list(token_counts(mb, positions, meta).values()), dtype=torch.float64)
                if positions:
                    result[torch.tensor(positions, dtype=torch.int64)] = out.detach().float().cpu()
        self.forward_metrics = self._summed_token_counts(counts)
        return result

    def _summed_token_counts(self, counts: Tensor) -> dict[str, float]:
        group = self.train_dp_group()
        if group is not None and dist.get_world_size(group) > 1:
            counts = counts.to(comm_device(group))
            dist.all_reduce(counts, group=group)
        real, computed = counts.cpu().tolist()
        return with_token_share({"num_tokens_real": real, "num_tokens_computed": computed})

    def _forward_presharded(self, meta: KVBatchMeta, out_field: str, forward: Any) -> KVBatchMeta | None:
        data = self.fetch_agreed(meta, [INPUT_IDS])
        result = self._forward_planned(data, meta, forward)
        if meta.size == 0:
            return meta if self.is_writeback_leader() else None
        return self.write_back(meta, {out_field: result}, token_fields=[out_field])


def token_counts(mb: TensorDictBase, positions: list[int], meta: KVBatchMeta) -> dict[str, float]:
    """The tokens a microbatch computes (rows x padded width; a dummy's one row too) and the real ones
    among them (its rows' lengths in ``meta``)."""
    ids = mb[INPUT_IDS]
    lengths = meta.sequence_lengths
    real = sum(int(lengths[i]) for i in positions) if lengths is not None else int(ids.numel()) if positions else 0
    return {"num_tokens_real": float(real), "num_tokens_computed": float(ids.numel())}


_NO_RANK = 2**62
_INTEGER_FIELDS = (INPUT_IDS, LOSS_MASK)


def _empty_batch(meta: KVBatchMeta, fields: list[str], device: torch.device) -> TensorDict:
    """A zero-row batch of ``fields`` for an empty shard: ids and masks int64, the rest float32,
    ``meta.extra_info["pad_to_length"]`` wide (the width its peers forward)."""
    width = int(meta.extra_info.get("pad_to_length") or 1)
    rows = {f: torch.zeros(0, width, dtype=torch.int64 if f in _INTEGER_FIELDS else torch.float32) for f in fields}
    return TensorDict(rows, batch_size=[0], device=device)


def full_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter of ``model`` whole (DTensors gathered), detached, on the CPU.

    A collective for sharded models: call it on every rank of the model's mesh.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).cpu().clone()
    return out
