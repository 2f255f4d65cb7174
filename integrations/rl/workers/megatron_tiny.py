"""The tiny reference model on Megatron-Core, and a complete worker for it (tests and examples; CUDA).

:func:`tiny_megatron_gpt` builds a Megatron GPT of a :class:`~integrations.rl.workers.model.TinyConfig`'s
shape that computes the same function as :class:`~integrations.rl.workers.model.TinyCausalLM` of that
shape (the examples' rollout model) when its attention's biases are zero: the local layer spec (no
Transformer Engine), learned absolute positions, LayerNorm, GELU, untied output layer.
:class:`TinyMegatronWorker` wraps it with Megatron's DDP and optimizer, can start from the FSDP2
worker's initial weights (``init="tiny"``: the attention's biases then zero and frozen, so the
trainable parameters are the tiny model's too), and names its exported weights for the tiny model
(:func:`~integrations.rl.workers.megatron_weights.tiny_name_map`), so a weight sync from Megatron
trainers lands in a tiny rollout model as is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from dataplane import InvalidArgument
from integrations.rl.workers.megatron import MegatronRLWorkerMixin, require_megatron
from integrations.rl.workers.megatron_weights import load_megatron_parameters, megatron_shapes, tiny_name_map

__all__ = ["TinyMegatronWorker", "tiny_megatron_gpt"]


class _ValueHead(torch.nn.Module):
    """A ``hidden -> 1`` head in place of a GPT's output layer (replicated over TP: its input is whole)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, 1)

    def forward(self, hidden_states: Tensor, weight: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
        return self.linear(hidden_states), None


def tiny_megatron_gpt(
    config: Any = None,
    *,
    seed: int = 0,
    calculate_per_token_loss: bool = True,
    overlap_grad_reduce: bool = False,
    optimizer: str = "sgd",
    lr: float = 1e-2,
    clip_grad: float = 1.0e9,
    init_method_std: float = 0.02,
    add_bias_linear: bool = True,
    tiny_weights: Mapping[str, Tensor] | None = None,
) -> tuple[Any, Any]:
    """A tiny Megatron GPT (local layer spec, no Transformer Engine, fp32) wrapped in Megatron's DDP,
    and its Megatron optimizer, for tests and examples. Call it on every rank after
    ``parallel_state.initialize_model_parallel``. It computes what a
    :class:`~integrations.rl.workers.model.TinyCausalLM` of the same shape computes with the weights
    :func:`~integrations.rl.workers.megatron_weights.tiny_name_map` maps, as long as its attention's
    biases are zero (the tiny model has none): ``tiny_weights`` makes it so.

    Weights are initialised on the CPU from ``seed`` (``use_cpu_initialization``), so the whole model
    is the same for every TP size: a TP = 2 model and a single-GPU one compute the same function. A
    later pipeline stage draws its layers' weights in another order (it builds no embedding), so
    across PP sizes load one model's weights into the other to compare them.

    Args:
        config: a :class:`~integrations.rl.workers.model.TinyConfig` (``head="value"``: a ``[B, T, 1]``
            value head replaces the output layer).
        calculate_per_token_loss: Megatron's flag (whether its DDP sums or averages over DP).
        overlap_grad_reduce: Megatron DDP's flag (gradient reduction dispatched from backward hooks).
        optimizer: ``"sgd"`` or ``"adam"``; ``lr``, ``clip_grad`` go to Megatron's ``OptimizerConfig``.
        init_method_std: Megatron's initial weight scale (``TransformerConfig.init_method_std``; output
            projections get it divided by ``sqrt(2 * n_layers)``).
        add_bias_linear: biases on every linear layer (Megatron's default).
        tiny_weights: a :class:`~integrations.rl.workers.model.TinyCausalLM`'s parameters (by its names)
            to start from instead of Megatron's initialisation: loaded into every rank's shards, with
            the attention's biases zero and frozen, so the model is that tiny model (trainable
            parameters and all) on Megatron-Core.

    Returns:
        ``(model, optimizer)``: the DDP-wrapped model on the current CUDA device and its optimizer.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from integrations.rl.workers.model import TinyConfig

    shape = config or TinyConfig()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if shape.n_layers % pp:
        raise InvalidArgument(f"n_layers={shape.n_layers} must divide by the pipeline-parallel size {pp}")
    tf = TransformerConfig(
        num_layers=shape.n_layers,
        hidden_size=shape.dim,
        num_attention_heads=shape.n_heads,
        ffn_hidden_size=4 * shape.dim,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=calculate_per_token_loss,
        init_method_std=init_method_std,
        add_bias_linear=add_bias_linear,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    pre, post = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    gpt = GPTModel(
        config=tf,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_len,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    if shape.head == "value" and post:
        gpt.output_layer = _ValueHead(shape.dim)
    if tiny_weights is not None:
        _start_from_tiny(gpt, tf, shape, tiny_weights)
    gpt = gpt.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(
        config=tf,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=False
        ),
        module=gpt,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=optimizer,
            lr=lr,
            weight_decay=0.0,
            clip_grad=clip_grad,
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
        ),
        [ddp],
    )
    # What Megatron's training loop installs: the schedule's hooks (the split step takes them over).
    tf.no_sync_func = ddp.no_sync
    tf.grad_sync_func = ddp.start_grad_sync if overlap_grad_reduce else None
    tf.finalize_model_grads_func = _finalize
    return ddp, opt


def _start_from_tiny(gpt: Any, tf: Any, shape: Any, weights: Mapping[str, Tensor]) -> None:
    """Load a tiny model's weights into ``gpt`` (this rank's shards) and freeze the attention's biases at zero."""
    heads = {"heads": tf.num_attention_heads, "groups": tf.num_query_groups, "head_dim": tf.kv_channels}
    whole = tiny_name_map(shape).to_megatron(weights, **heads, shapes=megatron_shapes(gpt))
    load_megatron_parameters(gpt, whole)
    for name, p in gpt.named_parameters():
        if re.search(r"self_attention\.linear_(qkv|proj)\.bias$", name):
            p.requires_grad_(False)  # zero, as the tiny model has none: the name map checks it stays so


def _finalize(model: list[Any], num_tokens: Tensor | None, **kwargs: Any) -> None:
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, num_tokens, **kwargs)


class TinyMegatronWorker(MegatronRLWorkerMixin):
    """A :func:`tiny_megatron_gpt` on every rank, with Megatron's parallel state set up if it is not yet
    (inside a trainer actor it is: :meth:`~MegatronRLWorkerMixin.setup_parallel_state`). Its exported
    weights carry the tiny model's names (:func:`~integrations.rl.workers.megatron_weights.tiny_name_map`).

    Build it on every rank of an initialised NCCL process group (one GPU per rank, the current device
    set); every rank passes the same arguments.

    Args:
        config: the model's shape (``head="value"`` for a critic).
        tp, pp: tensor- and pipeline-parallel sizes (DP = world / (tp * pp)); they must be the trainer
            group's.
        value_shift: see :class:`~integrations.rl.workers.base.RLWorkerMixin` (an ablation switch).
        init: ``"megatron"`` (Megatron's initialisation from ``seed``) or ``"tiny"`` (the initial weights
            of :class:`~integrations.rl.workers.tiny.TinyDTensorWorker` with the same ``seed`` and
            config: the FSDP2 worker's model, on Megatron-Core).
        seed: the initial weights' seed.
        options: :func:`tiny_megatron_gpt`'s keyword arguments (``lr``, ``optimizer``, ...).
    """

    def __init__(
        self,
        config: Any = None,
        *,
        tp: int = 1,
        pp: int = 1,
        value_shift: bool = True,
        init: Literal["megatron", "tiny"] = "megatron",
        seed: int = 0,
        **options: Any,
    ) -> None:
        from integrations.rl.workers.model import TinyCausalLM, TinyConfig

        parallel_state = require_megatron()
        if not dist.is_initialized():
            raise InvalidArgument("initialise torch.distributed (init_process_group) on every rank before the worker")
        if parallel_state.model_parallel_is_initialized():
            have = (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
            )
            if have != (tp, pp):
                raise InvalidArgument(
                    f"Megatron's parallel state is already tp={have[0]}, pp={have[1]}, not tp={tp}, pp={pp}; "
                    "call parallel_state.destroy_model_parallel() first to change it"
                )
        else:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.config = config or TinyConfig()
        weights = None
        if init == "tiny":  # TinyDTensorWorker's initial weights: the same seed, the same draws
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                weights = {n: p.detach() for n, p in TinyCausalLM(self.config).named_parameters()}
        elif init != "megatron":
            raise InvalidArgument(f"init must be 'megatron' or 'tiny', got {init!r}")
        self.model, self.optimizer = tiny_megatron_gpt(self.config, seed=seed, tiny_weights=weights, **options)
        self.value_shift = value_shift
        self.rollout_names = tiny_name_map(self.config)
