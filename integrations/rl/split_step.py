"""The split train step: one optimizer step built from microbatches that arrive one call at a time.

``begin_train_step(loss_fn)`` opens a step, ``train_microbatch(batch)`` runs one forward and
backward, ``finish_train_step()`` normalises, clips and steps, ``abort_train_step()`` drops it. An
async trainer can thus train on rows as they become ready and still take exactly the step a
synchronous trainer would take on the same rows.

How the numbers stay equal to a one-shot step:

* each microbatch's loss is the **unnormalised sum** of its valid elements (normaliser 1), and its
  local count (valid tokens, or valid sequences) is accumulated;
* ``finish`` all-reduces the counts over data parallel to the global ``N``, multiplies every gradient
  by ``1/N``, clips, and steps. Gradients are reduced by plain sum (see
  :func:`~integrations.rl.workers.dtensor.use_sum_reduction`), so the result equals dividing each
  microbatch's loss by ``N`` up front -- bitwise when ``N`` is a power of two (the scale is exact),
  to rounding otherwise;
* a planned microbatch with no rows still runs (a zero-loss dummy: its forward and backward join
  every collective its peers run), so ranks with fewer real rows never desync.

Metrics of the loss follow a naming rule when aggregated at ``finish``: ``*_min`` and ``*_max`` are
reduced by min and max, ``num_*`` are summed counts, ``lr`` is the learning rate of the step, and
anything else is an unnormalised sum divided by ``N`` (so it reads as a mean over the step). When the
microbatches report ``num_tokens_real`` and ``num_tokens_computed`` (the RL workers do), the step adds
``real_token_share``, their ratio: the share of the tokens it computed that were not padding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dataplane import DataPlaneError, InvalidArgument
from dataplane.worker.collective import comm_device

__all__ = [
    "LossFunction",
    "OpenStep",
    "PeerFailure",
    "SplitTrainStepMixin",
    "TrainStepError",
    "aggregate_metrics",
    "clip_grad_norm_",
    "grad_norm",
    "with_token_share",
]


class TrainStepError(DataPlaneError, RuntimeError):
    """A split-step call out of order: ``begin`` while a step is open, or a step call with none open."""


class PeerFailure(DataPlaneError, RuntimeError):
    """Another rank of the training group failed in the same microbatch; this rank's work was dropped.

    Every rank raises together (this one, the failing rank its own error), so none waits in a
    collective its peer never reaches. Abort the step on every rank, then start again.
    """


@runtime_checkable
class LossFunction(Protocol):
    """What the split step needs of a loss (:mod:`integrations.rl.losses` has two).

    Attributes:
        loss_type: ``"token"`` (count = valid tokens) or ``"sequence"`` (count = valid rows).
        input: what the worker's forward hands the loss, token-aligned ``[B, T]``: ``"logprobs"``
            or ``"values"``.
        fields: the batch fields the loss reads.
    """

    loss_type: Literal["token", "sequence"]
    input: Literal["logprobs", "values"]
    fields: tuple[str, ...]

    def __call__(self, outputs: Tensor, batch: Any) -> Any:
        """Return an object with ``loss`` (0-dim unnormalised sum), ``count`` (0-dim) and ``metrics``."""
        ...


def _check_loss_fn(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise InvalidArgument(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if getattr(loss_fn, "loss_type", None) not in ("token", "sequence"):
        raise InvalidArgument(
            f"loss_fn.loss_type must be 'token' or 'sequence', got {getattr(loss_fn, 'loss_type', None)!r}; "
            "use a loss from integrations.rl.losses or give yours that attribute"
        )
    if getattr(loss_fn, "input", None) not in ("logprobs", "values"):
        raise InvalidArgument(
            f"loss_fn.input must be 'logprobs' or 'values', got {getattr(loss_fn, 'input', None)!r}: it says what "
            "the worker's forward hands the loss"
        )


# -- metrics ---------------------------------------------------------------------------------------
def _kind(name: str) -> Literal["min", "max", "count", "lr", "sum"]:
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    if name.startswith("num_"):
        return "count"
    if name == "lr":
        return "lr"
    return "sum"


def _neutral(name: str) -> float:
    """The value of a metric that changes nothing when aggregated (a dummy microbatch's)."""
    kind = _kind(name)
    return math.inf if kind == "min" else -math.inf if kind == "max" else 0.0


def aggregate_metrics(
    per_microbatch: Iterable[Mapping[str, float]], n: float, *, group: Any | None = None
) -> dict[str, float]:
    """Combine microbatch metrics by the naming rule above, over this rank and (``group``) its DP peers.

    Every rank of ``group`` must call it with the same metric names (losses report the same names
    for every batch, empty ones included).

    >>> aggregate_metrics([{"loss": 3.0, "r_min": 1.0, "num_tokens": 2.0}, {"loss": 1.0, "r_min": 0.5, "num_tokens": 2.0}], 4.0)
    {'loss': 1.0, 'num_tokens': 4.0, 'r_min': 0.5}
    """
    sums: dict[str, float] = {}
    mins: dict[str, float] = {}
    maxs: dict[str, float] = {}
    lr: float | None = None
    for m in per_microbatch:
        for k, v in m.items():
            kind = _kind(k)
            if kind == "min":
                mins[k] = min(mins.get(k, math.inf), float(v))
            elif kind == "max":
                maxs[k] = max(maxs.get(k, -math.inf), float(v))
            elif kind == "lr":
                # the last microbatch's learning rate (the step's; the optimizer has not stepped yet)
                lr = float(v)
            else:
                sums[k] = sums.get(k, 0.0) + float(v)
    if group is not None:
        for values, op in ((sums, dist.ReduceOp.SUM), (mins, dist.ReduceOp.MIN), (maxs, dist.ReduceOp.MAX)):
            names = sorted(values)
            if names:
                t = torch.tensor([values[k] for k in names], dtype=torch.float64, device=comm_device(group))
                dist.all_reduce(t, op=op, group=group)
                values.update(zip(names, t.tolist(), strict=True))
    out = {k: (v if _kind(k) == "count" else v / n if n else 0.0) for k, v in sums.items()}
    out.update(mins)
    out.update(maxs)
    if lr is not None:
        out["lr"] = lr
    return dict(sorted(out.items()))


def with_token_share(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with ``real_token_share = num_tokens_real / num_tokens_computed`` added when it has
    both (the share of computed tokens that were not padding: what packing rows would save).

    >>> with_token_share({"num_tokens_real": 3.0, "num_tokens_computed": 4.0})["real_token_share"]
    0.75
    """
    real, computed = metrics.get("num_tokens_real"), metrics.get("num_tokens_computed")
    if real is not None and computed:
        metrics["real_token_share"] = real / computed
    return metrics


# -- gradient norm ---------------------------------------------------------------------------------
def grad_norm(parameters: Iterable[nn.Parameter]) -> Tensor:
    """The 2-norm of all gradients, plain tensors and DTensors (FSDP2, TP) alike, as a float64 CPU tensor.

    Each rank sums the squares of its local shards, grouped by the mesh dims they are sharded over,
    and each group's sum is all-reduced over those dims only (replicated dims are not summed twice).
    So FSDP-only and FSDP+TP parameters mix freely, with one small all-reduce per distinct sharding.
    A collective for sharded gradients: every rank of the mesh calls it with the same parameters.
    """
    from torch.distributed.tensor import DTensor

    buckets: dict[tuple[int, ...], tuple[tuple[Any, ...], Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            local = g.to_local()
            groups = tuple(
                g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if pl.is_shard() or pl.is_partial()
            )
        else:
            local, groups = g, ()
        key = tuple(id(x) for x in groups)
        if key not in buckets:
            buckets[key] = (groups, torch.zeros((), dtype=torch.float64, device=local.device))
        buckets[key][1].add_(local.detach().double().pow(2).sum())
    total = torch.zeros((), dtype=torch.float64)
    for groups, squares in buckets.values():
        for group in groups:
            dist.all_reduce(squares, group=group)
        total += squares.cpu()
    return total.sqrt()


def _scale_grads(params: Iterable[nn.Parameter], scale: float) -> None:
    # One in-place multiply per gradient: a foreach over DTensors of different meshes is not supported.
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Scale gradients in place so their total norm is at most ``max_norm``; return the norm before.

    ``max_norm=None`` only measures. Uses :func:`grad_norm`; the scale is ``max_norm / (norm + 1e-6)``
    as in ``torch.nn.utils.clip_grad_norm_``, applied only when it is below 1.
    """
    params = [p for p in parameters if p.grad is not None]
    total = float(grad_norm(params))
    if max_norm is not None and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            _scale_grads(params, coef)
    return total


# -- the step --------------------------------------------------------------------------------------
@dataclass(slots=True)
class OpenStep:
    """The state of an open split step: its loss, the local count of valid elements so far, each
    microbatch's local metrics, and how many microbatches ran (dummies included)."""

    loss_fn: Any
    count: Tensor
    metrics: list[dict[str, float]] = field(default_factory=list)
    microbatches: int = 0
    noted: dict[str, float] = field(default_factory=dict)


class SplitTrainStepMixin:
    """``begin_train_step`` / ``train_microbatch`` / ``finish_train_step`` / ``abort_train_step``.

    The host (a training worker, one per rank) provides:

    * ``self.model`` (an ``nn.Module``, FSDP2-sharded or plain), ``self.optimizer``, and optionally
      ``self.lr_scheduler`` (stepped once per finished step) and ``self.max_grad_norm`` (clip bound,
      None to only measure);
    * :meth:`train_dp_group` (counts and metrics are summed over it), :meth:`train_world_group`
      (every rank training this model, for the per-microbatch agreement) and :meth:`loss_inputs`
      (the forward: batch -> what ``loss_fn.input`` names, token-aligned ``[B, T]``).

    ``weight_version`` counts finished steps; it never moves on abort.

    The step's state machine (order of calls, counts, metrics, the version) lives here once. What a
    training framework does its own way is a method it overrides (the Megatron worker does): how a
    step opens (:meth:`_open_step`), how one microbatch runs forward and backward
    (:meth:`_forward_backward`), how the step's counts and metrics reach every rank
    (:meth:`_global_counts_and_metrics`), how gradients are scaled, synced, clipped and stepped
    (:meth:`_apply_step`), and what is cleared when a step closes or is dropped (:meth:`_close_step`,
    :meth:`_drop_step`). The defaults are plain torch and FSDP2.

    Failure contract: a second ``begin`` raises :class:`TrainStepError` and leaves the open step as
    it was; ``abort`` is idempotent; an exception in one rank's loss makes every rank of the training
    group raise in that microbatch (the others :class:`PeerFailure`) before any backward, and the
    step stays open for ``abort``. Parameters and optimizer state change only at the end of
    ``finish``, after its last collective, so an abort at any earlier point restores them exactly.
    An exception inside one rank's forward or backward cannot be agreed on this way (FSDP's own
    collectives are inside them): its peers wait until the process group's timeout.
    ``weight_version`` moves once per finished step, also when ``N == 0`` left the weights as they were.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any | None = None
    max_grad_norm: float | None = 1.0
    weight_version: int = 0
    _train_step: OpenStep | None = None

    # -- hooks ------------------------------------------------------------------------------------
    def train_dp_group(self) -> Any | None:
        """Process group over which counts and metrics are summed (the DP ranks); None alone."""
        return None

    def train_world_group(self) -> Any | None:
        """Every rank that trains this model (DP x TP x CP ...), for the per-microbatch agreement.
        Default: the default group when ``torch.distributed`` is initialised, else None."""
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def loss_inputs(self, batch: Any, loss_fn: Any) -> Tensor:
        """The forward of one microbatch: token-aligned ``[B, T]`` logprobs or values (``loss_fn.input``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss_inputs(batch, loss_fn)")

    # -- API --------------------------------------------------------------------------------------
    @property
    def train_step_open(self) -> bool:
        """Whether a step is open (begun, neither finished nor aborted)."""
        return self._train_step is not None

    def begin_train_step(self, loss_fn: Any) -> None:
        """Open a step that trains with ``loss_fn`` (see :class:`LossFunction`); gradients start at zero."""
        if self._train_step is not None:
            raise TrainStepError(
                "a train step is already open; finish_train_step() or abort_train_step() it before beginning another"
            )
        _check_loss_fn(loss_fn)
        self._open_step()
        self._train_step = OpenStep(loss_fn=loss_fn, count=torch.zeros((), dtype=torch.float64))

    def train_microbatch(
        self, batch: Any, *, dummy: bool = False, counts: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Forward and backward one microbatch.

        Every rank of the training group must call it the same number of times per step. A rank with
        fewer real microbatches than its peers runs dummies (``dummy=True``: any batch the model can
        forward, e.g. one row of padding; its loss is multiplied by 0, it counts nothing and its
        metrics are neutral), so it still joins every collective of every forward and backward.

        Args:
            batch: what :meth:`loss_inputs` and the loss read.
            dummy: see above.
            counts: metrics added as given, a dummy's too (e.g. ``num_tokens_computed``: a dummy's
                forward costs what it costs).

        Returns:
            this microbatch's local metrics, unnormalised (``loss`` is its sum).
        """
        step = self._require_open("train_microbatch")
        step.noted.clear()
        metrics, count = self._forward_backward(step, batch, dummy)
        metrics.update(step.noted)
        step.noted.clear()
        if dummy:
            metrics = {k: _neutral(k) for k in metrics}
        elif count is not None:
            step.count += count
        metrics.update(counts or {})
        step.microbatches += 1
        step.metrics.append(metrics)
        return metrics

    def note_microbatch_metrics(self, **values: float) -> None:
        """Add metrics to the microbatch being trained, from inside its forward (e.g. the policy's
        entropy, which only the forward sees). Named by the naming rule; neutral for a dummy.
        A no-op outside a step."""
        if self._train_step is not None:
            self._train_step.noted.update({k: float(v) for k, v in values.items()})

    def finish_train_step(self) -> dict[str, float]:
        """Normalise by the global count, clip, step the optimizer and scheduler; close the step.

        Returns:
            the step's metrics over all DP ranks (the same on every rank): the loss's metrics by the
            naming rule, plus ``loss``, ``grad_norm``, ``lr``, ``num_microbatches`` and ``num_elements``
            (the global ``N``). With ``N == 0`` (nothing valid anywhere) the optimizer does not step.
        """
        step = self._require_open("finish_train_step")
        try:
            n, microbatches, metrics = self._global_counts_and_metrics(step)
            norm, lr = self._apply_step(n)
        except BaseException:
            self.abort_train_step()
            raise
        self._close_step()
        self._train_step = None
        self.weight_version += 1
        metrics.update(grad_norm=norm, lr=lr, num_microbatches=microbatches, num_elements=n)
        return with_token_share(metrics)

    def abort_train_step(self) -> None:
        """Drop the open step: gradients cleared, parameters, optimizer state and version untouched.

        Idempotent; a no-op without an open step.
        """
        try:
            self._drop_step()
        finally:
            self._train_step = None

    # -- what a training framework overrides -------------------------------------------------------
    def _open_step(self) -> None:
        """Ready the model for a step's first microbatch: gradients zeroed, train mode."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()

    def _forward_backward(self, step: OpenStep, batch: Any, dummy: bool) -> tuple[dict[str, float], Tensor | None]:
        """One microbatch's forward, loss (agreed over the training group before any backward) and
        backward. Returns its local metrics and its count (float64, CPU; None: nothing to count)."""
        error: BaseException | None = None
        out: Any = None
        try:
            out = step.loss_fn(self.loss_inputs(batch, step.loss_fn), batch)
        except Exception as e:
            error = e
        self._agree(error)
        metrics = {"loss": float(out.loss.detach()), **{k: float(v) for k, v in out.metrics.items()}}
        if dummy:
            (out.loss * 0.0).backward()
            return metrics, None
        out.loss.backward()
        return metrics, out.count.detach().to(device="cpu", dtype=torch.float64)

    def _global_counts_and_metrics(self, step: OpenStep) -> tuple[float, float, dict[str, float]]:
        """The global ``N``, the DP total of microbatches, and the step's metrics by the naming rule."""
        group = self.train_dp_group()
        totals = torch.stack([step.count, torch.tensor(float(step.microbatches), dtype=torch.float64)])
        if group is not None:
            totals = totals.to(comm_device(group))
            dist.all_reduce(totals, group=group)
        n, microbatches = (float(x) for x in totals.cpu())
        return n, microbatches, aggregate_metrics(step.metrics, n, group=group)

    def _apply_step(self, n: float) -> tuple[float, float]:
        """Scale gradients by ``1/n``, clip, step the optimizer and scheduler (not when ``n == 0``).
        Returns the gradient norm before clipping and the step's learning rate."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if n > 0:
            _scale_grads(params, 1.0 / n)
        norm = clip_grad_norm_(params, self.max_grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        # Every collective of the step is behind us: from here on nothing waits for a peer.
        if n > 0:
            self.optimizer.step()
            self._step_scheduler()
        return norm, lr

    def _step_scheduler(self) -> None:
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _close_step(self) -> None:
        """Clear what a finished step leaves (its gradients)."""
        self.optimizer.zero_grad(set_to_none=True)

    def _drop_step(self) -> None:
        """Clear what a dropped step leaves: gradients, and FSDP2 modules gathered by a forward that raised."""
        self.optimizer.zero_grad(set_to_none=True)
        self._reshard()

    # -- internals --------------------------------------------------------------------------------
    def _require_open(self, what: str) -> OpenStep:
        if self._train_step is None:
            raise TrainStepError(f"{what}() needs an open step; call begin_train_step(loss_fn) first")
        return self._train_step

    def _agree(self, error: BaseException | None) -> None:
        """All ranks learn whether any failed, before a backward that would wait for the failed one."""
        group = self.train_world_group()
        if group is not None and dist.get_world_size(group) > 1:
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=comm_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if error is None and int(flag.item()):
                raise PeerFailure(
                    "another rank failed in this microbatch's forward or loss (its own error says why); "
                    "abort_train_step() on every rank, then begin again"
                )
        if error is not None:
            raise error

    def _reshard(self) -> None:
        """Put FSDP2 modules back to sharded, in case a forward raised with parameters gathered."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without distributed
            return
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
