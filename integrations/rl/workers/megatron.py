"""A worker mixin that trains a Megatron-Core model from the data plane (CUDA, megatron-core >= 0.19).

Mix :class:`MegatronRLWorkerMixin` into your Megatron training worker (one process per GPU)::

    class PolicyWorker(MegatronRLWorkerMixin):
        rollout_names = NameMap(table=MY_TABLE)   # Megatron names -> the rollout engine's (megatron_weights)

        def __init__(self):
            # parallel_state is set up already: by the Ray trainer actor (setup_parallel_state, from the
            # group's layout), or by you: parallel_state.initialize_model_parallel(tp, pp)
            self.model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=gpt)  # one chunk
            self.optimizer = get_megatron_optimizer(OptimizerConfig(...), [self.model])
            self.setup_data_plane(url)            # every rank (the trainer actor does it for you)

Inside the Ray trainer actors (:class:`~integrations.rl.trainer_actor.TrainerActor`, driven by
:class:`~integrations.rl.policy.Policy`), :meth:`MegatronRLWorkerMixin.setup_parallel_state` initialises
``parallel_state`` once per build with the group's ``tp`` and ``pp`` (DP is what is left), before any
factory runs, and :meth:`~MegatronRLWorkerMixin.teardown_parallel_state` destroys it before a rebuild;
:meth:`~MegatronRLWorkerMixin.export_weights` gathers the TP / PP shards into whole parameters named
for the rollout model (:mod:`integrations.rl.workers.megatron_weights`), which is what a weight sync
sends. The tiny reference model and its worker are :mod:`integrations.rl.workers.megatron_tiny`.

The calls are the FSDP2 worker's (:class:`~integrations.rl.workers.base.RLWorkerMixin`):
``train_presharded``, ``get_logprobs_presharded``, ``get_values_presharded`` and the split step
``begin_train_step`` / ``train_microbatch`` / ``finish_train_step`` / ``abort_train_step``.

Groups come from ``megatron.core.parallel_state``: the replica group of a rank is its model-parallel
group (the TP x PP ranks of one DP rank), its leader the rank with ``tp = pp = 0``. Logprobs and values
are computed on the last pipeline stage and broadcast over the pipeline group to the first, so they
reach the leader before it writes them back. Context parallelism is not supported yet (CP must be 1).

The split step on Megatron. Megatron's one-shot step runs every microbatch through its schedule,
whose hooks (``config.no_sync_func``, ``config.grad_sync_func``, ``config.finalize_model_grads_func``)
reduce gradients once, after the last microbatch. A split step gets its microbatches one call at a
time, so it takes those hooks over:

* ``begin_train_step`` zeroes the gradient buffers and saves, then nulls, the three hooks
  (``no_sync_func`` becomes a null context: with PP = 1 the schedule runs its last microbatch outside
  ``no_sync_func``, and a real one would leave gradient sync enabled and dispatch it early);
* each ``train_microbatch`` runs the schedule on one microbatch inside ``model.no_sync()``, its loss the
  unnormalised sum (the loss function's count is kept aside, the schedule sees 1);
* ``finish_train_step`` sums the counts over DP (from the last stage), applies the true normaliser with
  ``model.scale_gradients``, then runs the saved ``finalize_model_grads`` once (the DP reduction,
  pipeline embedding and layernorm reductions), and steps Megatron's optimizer (which clips per its
  ``OptimizerConfig.clip_grad``);
* the hooks are restored at finish, at abort, and whenever an entry point raises.

A loss function that raises on the last stage does not strand the other stages in the schedule's
point-to-point calls: its microbatch finishes with a zero loss, then every rank learns of the failure
(the failing ones raise their error, the others :class:`~integrations.rl.split_step.PeerFailure`)
and the step is aborted. An exception inside the model's own forward cannot be agreed on this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import Tensor

from dataplane import InvalidArgument, KVBatchMeta
from dataplane.checks import check_number
from dataplane.worker.collective import comm_device
from integrations.rl.conventions import INPUT_IDS, shift_to_tokens
from integrations.rl.split_step import OpenStep, aggregate_metrics
from integrations.rl.workers.base import RLWorkerMixin, eval_mode
from integrations.rl.workers.layout import RankLayout
from integrations.rl.workers.megatron_weights import (
    NameMap,
    gather_megatron_parameters,
    load_megatron_parameters,
    megatron_shapes,
)

__all__ = ["MegatronRLWorkerMixin", "megatron_token_logprobs", "require_megatron"]

_HOOKS = ("grad_sync_func", "no_sync_func", "finalize_model_grads_func")


def _null_no_sync() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def require_megatron() -> Any:
    """``megatron.core.parallel_state``, or :class:`~dataplane.InvalidArgument` saying what is missing:
    megatron-core (``pip install 'dataplane[megatron]'``, Python >= 3.12) or a CUDA device."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise InvalidArgument(
            "the Megatron worker needs megatron-core, which this Python "
            f"({sys.version_info.major}.{sys.version_info.minor}) does not have: pip install 'dataplane[megatron]' "
            "(Python >= 3.12, CUDA), or use the FSDP2 worker"
        )
    if not torch.cuda.is_available():
        raise InvalidArgument(
            "the Megatron worker trains on CUDA GPUs only, and this process sees none "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): run it on a GPU "
            "(--device cuda: each trainer rank gets one), or use the FSDP2 worker on the CPU"
        )
    from megatron.core import parallel_state

    return parallel_state


def megatron_token_logprobs(logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Token-aligned logprobs ``[B, T]`` (float32, position 0 holds 0) from vocab-parallel logits.

    ``logits`` is Megatron's ``[B, T, V / TP]`` output (``parallel_output=True``); the log-softmax over
    the whole vocabulary is Megatron's ``vocab_parallel_cross_entropy`` (one all-reduce over TP), so
    no rank gathers ``[B, T, V]``. Differentiable: the train step backpropagates through it.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    check_number("temperature", temperature, low=0, low_open=True)
    b, t = input_ids.shape
    out = torch.zeros(b, t, dtype=torch.float32, device=logits.device)
    if t > 1:
        # [B, T-1, V/TP] -> [T-1, B, V/TP] as Megatron expects; dividing makes the fresh tensor the
        # cross entropy may modify in place.
        scaled = (logits[:, :-1].float() / temperature).transpose(0, 1).contiguous()
        nll = vocab_parallel_cross_entropy(scaled, input_ids[:, 1:].transpose(0, 1).contiguous())
        out = torch.cat([out[:, :1], -nll.transpose(0, 1).float()], dim=1)
    return out


class MegatronRLWorkerMixin(RLWorkerMixin):
    """RL worker glue for Megatron-Core models; see the module docstring.

    The host sets ``model`` (one Megatron ``DistributedDataParallel`` chunk: virtual pipeline stages
    are not supported), ``optimizer`` (Megatron's, from ``get_megatron_optimizer``), optionally
    ``lr_scheduler`` (Megatron's ``OptimizerParamScheduler`` is stepped with
    ``increment=lr_scheduler_increment``, anything else with ``step()``), and calls
    :meth:`~dataplane.worker.DataPlaneWorkerMixin.setup_data_plane` on every rank after
    ``parallel_state.initialize_model_parallel``.

    Override :meth:`megatron_forward` for a model whose forward takes other arguments, and
    :meth:`logprobs_from_output` / :meth:`values_from_output` for other outputs. Clipping is the
    optimizer's (``OptimizerConfig.clip_grad``); ``max_grad_norm`` is not used.

    Attributes:
        lr_scheduler_increment: what a Megatron scheduler's ``step(increment=...)`` gets per finished
            step (it counts samples: give it the global batch size).
        rollout_names: how :meth:`export_weights` names the whole parameters for the rollout model
            (a :class:`~integrations.rl.workers.megatron_weights.NameMap`); None keeps Megatron's own
            names (as a TP = PP = 1 model has them, without the DDP wrapper's ``module.``).
    """

    model: Any  # Megatron's DistributedDataParallel
    optimizer: Any  # a MegatronOptimizer
    lr_scheduler_increment: int = 1
    rollout_names: NameMap | None = None
    _saved_hooks: dict[str, Any] | None = None
    _microbatch_error: BaseException | None = None

    # -- parallel state ---------------------------------------------------------------------------
    @classmethod
    def setup_parallel_state(cls, layout: RankLayout) -> None:
        """Initialise Megatron's ``parallel_state`` on this rank: TP and PP from ``layout``, DP the rest,
        in Megatron's default rank order (which is the layout's). A state already initialised with the
        same sizes is kept; other sizes are refused (destroy it first). Every rank calls it together
        (it creates process groups), after ``init_process_group``."""
        ps = require_megatron()
        if not dist.is_initialized():
            raise InvalidArgument("initialise torch.distributed (init_process_group) on every rank first")
        if layout.world != dist.get_world_size():
            raise InvalidArgument(
                f"the layout dp={layout.dp} x tp={layout.tp} x pp={layout.pp} has {layout.world} ranks, the "
                f"process group {dist.get_world_size()}: give the trainer group one rank per GPU of the layout"
            )
        if ps.model_parallel_is_initialized():
            have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
            if have == (layout.tp, layout.pp):
                return
            raise InvalidArgument(
                f"Megatron's parallel state is already tp={have[0]}, pp={have[1]}, not tp={layout.tp}, "
                f"pp={layout.pp}: call parallel_state.destroy_model_parallel() first"
            )
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
        rank = dist.get_rank()
        got = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())
        want = (layout.tp_rank(rank), layout.dp_rank(rank), layout.pp_rank(rank))
        if got != want:  # the driver shards by the layout: a rank in another place would train other rows
            ps.destroy_model_parallel()
            raise InvalidArgument(
                f"rank {rank}: Megatron placed it at (tp, dp, pp) = {got}, the layout at {want}; "
                "use Megatron's default order (tp-cp-ep-dp-pp)"
            )

    @classmethod
    def teardown_parallel_state(cls) -> None:
        """Destroy Megatron's ``parallel_state`` (its groups are dropped; a later set-up makes new ones)."""
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()

    @staticmethod
    def _ps() -> Any:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise InvalidArgument(
                "Megatron's model parallel state is not initialised: call "
                "parallel_state.initialize_model_parallel(...) on every rank before the worker's calls"
            )
        if parallel_state.get_context_parallel_world_size() != 1:
            raise InvalidArgument("MegatronRLWorkerMixin supports context_parallel_size=1 only")
        return parallel_state

    def export_weights(self) -> dict[str, Tensor]:
        """Whole parameters on the CPU named for the rollout model (a collective on every rank of the model):
        :func:`~integrations.rl.workers.megatron_weights.gather_megatron_parameters`, then
        :attr:`rollout_names`."""
        whole = gather_megatron_parameters(self.model)
        return whole if self.rollout_names is None else self.rollout_names.apply(whole, **self._heads())

    def import_weights(self, params: dict[str, Tensor]) -> None:
        """Load whole parameters named for the rollout model (what :meth:`export_weights` returns: a
        checkpoint of the rollout model, say) into this rank's shards, through :attr:`rollout_names`'
        inverse (Megatron's own names when it is None); no collective. The optimizer's copies follow
        (``reload_model_params``)."""
        whole = params
        if self.rollout_names is not None:
            whole = self.rollout_names.to_megatron(params, **self._heads(), shapes=megatron_shapes(self.model))
        load_megatron_parameters(self.model, whole)
        reload = getattr(self.optimizer, "reload_model_params", None)
        if reload is not None:
            reload()

    def _heads(self) -> dict[str, int]:
        cfg = self.megatron_config()
        heads = int(cfg.num_attention_heads)
        return {
            "heads": heads,
            "groups": int(cfg.num_query_groups or heads),
            "head_dim": int(cfg.kv_channels or cfg.hidden_size // heads),
        }

    def compute_device(self) -> torch.device:
        """The current CUDA device (Megatron trains on GPUs only)."""
        return torch.device("cuda", torch.cuda.current_device())

    def replica_group(self) -> Any | None:
        """This rank's model-parallel group (TP x PP ranks of one DP rank), None when it is one rank."""
        ps = self._ps()
        if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() == 1:
            return None
        return ps.get_model_parallel_group()

    def is_writeback_leader(self) -> bool:
        """True on the rank with tensor- and pipeline-parallel rank 0."""
        ps = self._ps()
        return bool(ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0)

    def train_dp_group(self) -> Any | None:
        ps = self._ps()
        return ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None

    def train_world_group(self) -> Any | None:
        return dist.group.WORLD

    # -- the host's model -------------------------------------------------------------------------
    def megatron_config(self) -> Any:
        """The model's ``TransformerConfig`` (``megatron.core.utils.get_model_config``)."""
        from megatron.core.utils import get_model_config

        return get_model_config(self.model)

    def megatron_forward(self, model: Any, input_ids: Tensor) -> Tensor:
        """One forward of ``input_ids [B, T]`` on this pipeline stage: the stage's output tensor.

        The default is a GPT forward with positions ``0..T-1`` and the causal mask the attention
        builds itself. On the last stage the output is ``[B, T, V / TP]`` logits (or ``[B, T, 1]``
        for a value head); on the others, the hidden states the schedule sends on.
        """
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        return model(input_ids, positions, None)  # type: ignore[no-any-return]

    def logprobs_from_output(self, output: Tensor, input_ids: Tensor) -> Tensor:
        """Token-aligned logprobs ``[B, T]`` from the last stage's output (see :func:`megatron_token_logprobs`)."""
        return megatron_token_logprobs(output, input_ids, temperature=self.logprob_temperature)

    def values_from_output(self, output: Tensor, input_ids: Tensor) -> Tensor:
        """Token-aligned values ``[B, T]`` from a value head's ``[B, T, 1]`` (or ``[B, T]``) output."""
        values = output.squeeze(-1) if output.dim() == 3 else output
        if values.dim() != 2 or values.shape != input_ids.shape:
            raise InvalidArgument(
                f"a value model's last stage must output [B, T, 1] or [B, T], got {tuple(output.shape)} "
                f"for input_ids {tuple(input_ids.shape)}; override values_from_output for other heads"
            )
        values = values.float()
        return shift_to_tokens(values) if self.value_shift else values

    def _loss_inputs_from_output(self, output: Tensor, input_ids: Tensor, kind: str) -> Tensor:
        if kind == "logprobs":
            return self.logprobs_from_output(output, input_ids)
        return self.values_from_output(output, input_ids)

    # -- the schedule -----------------------------------------------------------------------------
    def _run_schedule(self, batch: Any, loss_func: Callable[[Tensor, Any], Any], *, forward_only: bool) -> list[Any]:
        """Megatron's forward(-backward) schedule on one microbatch; returns the last stage's
        ``loss_func`` results (empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ids = batch[INPUT_IDS]

        def forward_step(data_iterator: Iterator[Any], model: Any) -> tuple[Tensor, Callable[[Tensor], Any]]:
            mb = next(data_iterator)
            output = self.megatron_forward(model, mb[INPUT_IDS])
            return output, lambda out: loss_func(out, mb)

        fb = get_forward_backward_func()
        return fb(  # type: ignore[no-any-return]
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=[self.model],
            num_microbatches=1,
            seq_length=int(ids.shape[1]),
            micro_batch_size=int(ids.shape[0]),
            forward_only=forward_only,
        )

    # -- forward-only calls -----------------------------------------------------------------------
    def _forward_planned(self, data: TensorDictBase, meta: KVBatchMeta, forward: Any) -> Tensor:
        kind = "values" if forward == self.token_values_of else "logprobs"
        ps = self._ps()
        width = int(data[INPUT_IDS].shape[1]) if meta.size else 0
        device = self.compute_device()
        result = torch.zeros(meta.size, width, dtype=torch.float32, device=device)

        def collect(output: Tensor, mb: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            values = self._loss_inputs_from_output(output, mb[INPUT_IDS], kind)
            one = torch.ones((), dtype=torch.int, device=output.device)
            return output.new_zeros(()), one, {"out": values.detach()}

        with eval_mode(self.model):
            for positions, mb in self.planned_microbatches(data, meta, self.forward_micro_batch_size):
                outs = self._run_schedule(mb, collect, forward_only=True)
                if positions and outs:
                    result[torch.tensor(positions, dtype=torch.int64, device=device)] = outs[0]["out"].float()
        if ps.get_pipeline_model_parallel_world_size() > 1 and result.numel():
            dist.broadcast(
                result, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
        return result.cpu()

    def token_logprobs_of(self, input_ids: Tensor) -> Tensor:
        """Token-aligned logprobs of ``input_ids`` (a whole-model call; with PP > 1 use the presharded calls)."""
        return self._whole_model_forward(input_ids, "logprobs")

    def token_values_of(self, input_ids: Tensor) -> Tensor:
        """Token-aligned values of ``input_ids`` (a whole-model call; with PP > 1 use the presharded calls)."""
        return self._whole_model_forward(input_ids, "values")

    def _whole_model_forward(self, input_ids: Tensor, kind: str) -> Tensor:
        if self._ps().get_pipeline_model_parallel_world_size() > 1:
            raise InvalidArgument(
                "with pipeline parallelism a forward spans several ranks: use get_logprobs_presharded / "
                "forward_logprobs (every rank of the model calls them)"
            )
        return self._loss_inputs_from_output(self.megatron_forward(self.model, input_ids), input_ids, kind)

    # -- the split step: what differs from FSDP2 (SplitTrainStepMixin runs the step) ----------------
    def _open_step(self) -> None:
        """Gradient buffers zeroed, Megatron's sync hooks saved and nulled (see the module docstring)."""
        self._ps()
        config = self.megatron_config()
        self._saved_hooks = {name: getattr(config, name) for name in _HOOKS}
        try:
            config.grad_sync_func = None
            config.no_sync_func = _null_no_sync
            config.finalize_model_grads_func = None
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.model.train()
        except BaseException:
            self._restore_hooks()
            raise

    def _forward_backward(self, step: OpenStep, batch: Any, dummy: bool) -> tuple[dict[str, float], Tensor | None]:
        """One microbatch through Megatron's schedule, gradients kept local; its metrics and count on
        the last pipeline stage (``{}`` and None on the others). On any exception the step is aborted
        (hooks restored, gradients zeroed) and the exception re-raised."""
        self._microbatch_error = None
        try:
            with self.model.no_sync():
                outs = self._run_schedule(batch, self._train_loss(step, dummy), forward_only=False)
            error, self._microbatch_error = self._microbatch_error, None
            self._agree(error)
        except BaseException:
            self.abort_train_step()
            raise
        if not outs:
            return {}, None
        return dict(outs[0]["metrics"]), None if dummy else outs[0]["count"]

    def _train_loss(self, step: OpenStep, dummy: bool) -> Callable[[Tensor, Any], Any]:
        def loss_func(output: Tensor, mb: Any) -> tuple[Tensor, Tensor, dict[str, Any]]:
            one = torch.ones((), dtype=torch.int, device=output.device)
            try:
                inputs = self._loss_inputs_from_output(output, mb[INPUT_IDS], step.loss_fn.input)
                result = step.loss_fn(inputs, mb)
                metrics = {"loss": float(result.loss.detach()), **{k: float(v) for k, v in result.metrics.items()}}
                count = result.count.detach().to(device="cpu", dtype=torch.float64)
                loss = result.loss * 0.0 if dummy else result.loss
            except Exception as e:  # finish the schedule with a zero loss; train_microbatch raises after it
                self._microbatch_error = e
                return output.sum() * 0.0, one, {"metrics": {}, "count": torch.zeros((), dtype=torch.float64)}
            # The schedule divides by the count it is given unless calculate_per_token_loss: it gets 1,
            # so the backward runs on the unnormalised sum and finish applies the true N.
            return loss, one, {"metrics": metrics, "count": count}

        return loss_func

    def _apply_step(self, n: float) -> tuple[float, float]:
        """Apply the true normaliser, run Megatron's gradient finalisation once, step Megatron's
        optimizer (which clips) and the scheduler. ``grad_norm`` is the optimizer's, before clipping."""
        from megatron.core.distributed import finalize_model_grads

        ps = self._ps()
        config = self.megatron_config()
        if n > 0:
            # Megatron's DDP multiplies gradients by 1/DP before its sum unless the model computes
            # a per-token loss; cancel that so the result is sum / N.
            dp = 1 if config.calculate_per_token_loss else ps.get_data_parallel_world_size(with_context_parallel=True)
            self.model.scale_gradients(dp / n)
        if self.model.ddp_config.overlap_grad_reduce:
            self.model.start_grad_sync()  # nothing was dispatched under no_sync: finalize waits on this
        saved = (self._saved_hooks or {}).get("finalize_model_grads_func")
        (saved or finalize_model_grads)([self.model], None)
        lr = float(self.optimizer.param_groups[0]["lr"])
        norm = 0.0
        if n > 0:
            _, grad_norm, _ = self.optimizer.step()
            norm = float(grad_norm) if grad_norm is not None else 0.0
            self._step_scheduler()
        return norm, lr

    def _step_scheduler(self) -> None:
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "num_steps"):  # OptimizerParamScheduler
            self.lr_scheduler.step(increment=self.lr_scheduler_increment)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _global_counts_and_metrics(self, step: OpenStep) -> tuple[float, float, dict[str, float]]:
        """``N``, the DP total of microbatches and the aggregated metrics, from the last pipeline stage
        (where the loss runs) to every stage."""
        ps = self._ps()
        group = self.train_dp_group()
        device = self.compute_device()
        totals = torch.stack([step.count, torch.tensor(float(step.microbatches), dtype=torch.float64)]).to(device)
        if group is not None:
            dist.all_reduce(totals, group=group)
        pp_group = ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1 else None
        last = ps.get_pipeline_model_parallel_last_rank()
        if pp_group is not None:
            dist.broadcast(totals, src=last, group=pp_group)
        n, microbatches = (float(x) for x in totals.cpu())
        metrics = aggregate_metrics(step.metrics, n, group=group)
        if pp_group is not None:
            box: list[Any] = [metrics]
            dist.broadcast_object_list(box, src=last, group=pp_group, device=comm_device(pp_group))
            metrics = box[0]
        return n, microbatches, metrics

    def _close_step(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._restore_hooks()

    def _drop_step(self) -> None:
        try:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        finally:
            self._restore_hooks()

    def _restore_hooks(self) -> None:
        saved, self._saved_hooks = self._saved_hooks, None
        if saved is None:
            return
        config = self.megatron_config()
        for name, value in saved.items():
            setattr(config, name, value)
