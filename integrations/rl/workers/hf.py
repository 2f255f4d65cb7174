"""Hugging Face causal LMs (Llama, Qwen2, Mistral, ...) on the FSDP2 trainer.

Needs ``transformers`` (``pip install 'dataplane[hf]'``); nothing here downloads: a model is built
from a config (random init from a seed) or loaded from a local directory (``save_pretrained``'s).

* :class:`CausalLMPolicy` wraps a causal LM so that its forward returns token-aligned log-probs
  computed one chunk of logits at a time (:func:`~integrations.rl.conventions.chunked_token_logprobs`)
  and never the whole ``[B, T, V]``: it is the FSDP2 root, so the output layer is gathered while the
  chunks (and their recompute in the backward) read it;
* :class:`CausalLMValue` is a critic of the same family: the base model and a scalar head;
* :func:`shard_hf_model` shards either with FSDP2 per decoder layer and at the root, bf16 or fp32,
  with activation checkpointing per layer on a flag;
* :class:`HFCausalLMWorker` is the whole trainer rank: model, optimizer, learning-rate schedule and
  clipping, on a ``("dp",)`` mesh over every rank.

In your own FSDP2 trainer the lines to add are (see ``docs/rl/hf.md``)::

    policy = CausalLMPolicy(AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.float32))
    shard_hf_model(policy, mesh, precision="bf16")       # instead of your fully_shard calls
    self.model, self.chunked_logprobs = policy, True      # on your DTensorRLWorkerMixin

:func:`tiny_config` builds small configs of these families (any causal LM loads from a directory):

>>> FAMILIES
('qwen2', 'llama', 'mistral')
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dataplane import InvalidArgument
from dataplane.checks import check_int
from integrations.rl.conventions import chunked_token_logprobs
from integrations.rl.optim import build_optimizer, lr_schedule
from integrations.rl.workers.dtensor import DTensorRLWorkerMixin, use_sum_reduction

__all__ = [
    "FAMILIES",
    "CausalLMPolicy",
    "CausalLMValue",
    "HFCausalLMWorker",
    "decoder_layers",
    "load_causal_lm",
    "qwen2_0_5b_config",
    "shard_hf_model",
    "tiny_config",
]

#: Families :func:`tiny_config` builds (any ``AutoModelForCausalLM`` loads from a directory).
FAMILIES = ("qwen2", "llama", "mistral")

Source = Any  # a transformers PretrainedConfig, or a local directory (str / os.PathLike)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("Hugging Face models need transformers: pip install 'dataplane[hf]'") from e
    return transformers


def tiny_config(
    family: str = "qwen2",
    *,
    vocab_size: int = 32,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_positions: int = 256,
    tie_word_embeddings: bool | None = None,
    **extra: Any,
) -> Any:
    """A small config of ``family`` (``"qwen2"``, ``"llama"``, ``"mistral"``) for tests and CPU examples:
    grouped-query attention (``num_kv_heads``), RMSNorm, rotary positions, SwiGLU as in the real ones.
    Embeddings are tied for Qwen2 (as in Qwen2.5-0.5B) and untied otherwise, unless given; ``extra``
    goes to the config as is (e.g. ``initializer_range``)."""
    if family not in FAMILIES:
        raise InvalidArgument(f"family must be one of {FAMILIES}, got {family!r}")
    for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
        check_int(name, value, low=1)
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise InvalidArgument(
            f"hidden_size={hidden_size} must divide by num_heads={num_heads}, and that by num_kv_heads={num_kv_heads}"
        )
    return _transformers().AutoConfig.for_model(
        family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=family == "qwen2" if tie_word_embeddings is None else tie_word_embeddings,
        **extra,
    )


def qwen2_0_5b_config(**overrides: Any) -> Any:
    """The shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4,864,
    vocabulary 151,936, tied embeddings) as a config: random init, nothing downloaded."""
    shape: dict[str, Any] = {
        "vocab_size": 151_936,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4_864,
        "max_position_embeddings": 32_768,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    return _transformers().AutoConfig.for_model("qwen2", **{**shape, **overrides})


def _dtype_kwarg() -> str:
    major = int(_transformers().__version__.split(".")[0])
    return "dtype" if major >= 5 else "torch_dtype"


def load_causal_lm(source: Source, *, seed: int = 0, base_only: bool = False) -> nn.Module:
    """A float32 ``AutoModelForCausalLM`` (``base_only``: the ``AutoModel`` under it, for a critic).

    Args:
        source: a config (random init from ``seed``; every rank building with the same seed gets the
            same weights) or a local directory written by ``save_pretrained`` (never a hub name:
            ``local_files_only``).
        seed: the initial weights of a config's model.
        base_only: the base model without the output layer.
    """
    tf = _transformers()
    auto = tf.AutoModel if base_only else tf.AutoModelForCausalLM
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isdir(source):
            raise InvalidArgument(
                f"{os.fspath(source)!r} is not a local directory; save_pretrained() one or pass a config"
            )
        model = auto.from_pretrained(os.fspath(source), local_files_only=True, **{_dtype_kwarg(): torch.float32})
    elif isinstance(source, tf.PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(source, **{_dtype_kwarg(): torch.float32})
    else:
        raise InvalidArgument(f"source must be a transformers config or a local directory, got {type(source).__name__}")
    return model  # type: ignore[no-any-return]


def _cache_kwarg(lm: nn.Module) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


class CausalLMPolicy(nn.Module):
    """A causal LM whose forward returns token-aligned log-probs, one chunk of logits at a time.

    ``forward(input_ids, *, output="logprobs", temperature=1.0, entropy=False)`` runs the base model
    to its last hidden states and then :func:`~integrations.rl.conventions.chunked_token_logprobs`
    with the output layer's weight: ``[B, T]`` float32 (with ``entropy``, the pair with the
    entropies); ``output="logits"`` gives the model's ``[B, T, V]`` logits instead. Make it the FSDP2
    root (:func:`shard_hf_model`): the root's parameters (embeddings, final norm, output layer) stay
    gathered from its forward to its backward, which is when the chunks read the output layer.

    Models that change their logits after the output layer (soft-capping, a logit scale) are refused.

    Attributes:
        lm: the wrapped ``...ForCausalLM`` (parameter names are ``lm.`` + its own).
        chunk_tokens: token positions per chunk of logits.
    """

    lm: Any

    def __init__(self, lm: nn.Module, *, chunk_tokens: int = 1024) -> None:
        super().__init__()
        cfg = getattr(lm, "config", None)
        for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
            if getattr(cfg, attr, None) not in (None, 1.0):
                raise InvalidArgument(f"{type(lm).__name__} transforms its logits ({attr}); CausalLMPolicy cannot")
        if not hasattr(lm, "get_decoder") or not hasattr(lm, "get_output_embeddings"):
            raise InvalidArgument(f"expected a transformers ...ForCausalLM, got {type(lm).__name__}")
        self.lm = lm
        self.chunk_tokens = check_int("chunk_tokens", chunk_tokens, low=1)

    @property
    def vocab_size(self) -> int:
        return int(self.lm.get_output_embeddings().weight.shape[0])

    def forward(
        self,
        input_ids: Tensor,
        *,
        output: Literal["logits", "logprobs"] = "logprobs",
        temperature: float = 1.0,
        entropy: bool = False,
    ) -> Any:
        if output == "logits":
            return self.lm(input_ids=input_ids, use_cache=False).logits
        if output != "logprobs":
            raise InvalidArgument(f"output must be 'logits' or 'logprobs', got {output!r}")
        hidden = self.lm.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        head = self.lm.get_output_embeddings()
        return chunked_token_logprobs(
            hidden,
            head.weight,
            input_ids,
            temperature=temperature,
            chunk_tokens=self.chunk_tokens,
            with_entropy=entropy,
            bias=head.bias,
        )

    @torch.no_grad()
    def step(self, input_ids: Tensor, cache: Any = None) -> tuple[Tensor, Any]:
        """Incremental forward for sampling (:func:`integrations.rl.rollout.generate`, an unsharded
        model): the logits of ``input_ids``, the positions after ``cache``'s, and the extended cache."""
        out = self.lm(input_ids=input_ids, use_cache=True, **{_cache_kwarg(self.lm): cache})
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return out.logits, cache


class CausalLMValue(nn.Module):
    """A critic: a base model (``AutoModel``) and a scalar head; ``forward(input_ids) -> [B, T]``
    float32, the value after seeing tokens ``0..t`` (the worker shifts it right, as for any critic).

    The head starts at the config's ``initializer_range`` (normal weights, zero bias) from ``seed``.
    """

    model: Any

    def __init__(self, base: nn.Module, *, seed: int = 0) -> None:
        super().__init__()
        cfg: Any = base.config
        self.model = base
        self.score = nn.Linear(int(cfg.hidden_size), 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            nn.init.normal_(self.score.weight, std=float(getattr(cfg, "initializer_range", 0.02)))
            nn.init.zeros_(self.score.bias)

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.score(hidden).squeeze(-1).float()  # type: ignore[no-any-return]


def _pretrained(module: nn.Module) -> Any:
    inner = (
        module.lm
        if isinstance(module, CausalLMPolicy)
        else module.model
        if isinstance(module, CausalLMValue)
        else module
    )
    if not hasattr(inner, "_no_split_modules"):
        raise InvalidArgument(
            f"expected a transformers model (or a CausalLMPolicy / CausalLMValue), got {type(module).__name__}"
        )
    return inner


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model (the classes its ``_no_split_modules`` names), in order."""
    names = set(_pretrained(module)._no_split_modules or ())
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:
        raise InvalidArgument(f"found no decoder layers ({sorted(names)}) in {type(module).__name__}")
    return layers


def shard_hf_model(
    module: nn.Module,
    mesh: Any,
    *,
    precision: Literal["bf16", "fp32"] = "bf16",
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Shard ``module`` (a :class:`CausalLMPolicy`, a :class:`CausalLMValue` or a plain transformers
    model) in place over the ``"dp"`` dim of ``mesh`` (or a 1-D mesh): FSDP2 per decoder layer, then
    the root, gradients reduced by plain sum (:func:`~integrations.rl.workers.dtensor.use_sum_reduction`).

    Args:
        precision: ``"bf16"``: parameters gathered and computed in bfloat16, gradients reduced in
            float32 (``MixedPrecisionPolicy``; the optimizer keeps float32 weights); ``"fp32"``: all float32.
        activation_checkpointing: recompute each decoder layer in the backward instead of keeping its
            activations (transformers' own per-layer checkpointing, which runs in train mode only).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision not in ("bf16", "fp32"):
        raise InvalidArgument(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    dp_mesh = mesh["dp"] if "dp" in names else mesh
    if dp_mesh.ndim != 1:
        raise InvalidArgument(f"shard over a 1-D mesh or a mesh with a 'dp' dim, got dims {names}")
    if activation_checkpointing:
        inner = _pretrained(module)
        if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5
            inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(module):
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    use_sum_reduction(module)
    return module


class HFCausalLMWorker(DTensorRLWorkerMixin):
    """A trainer rank of a Hugging Face causal LM: FSDP2 over every rank (a ``("dp",)`` mesh), its
    optimizer, learning-rate schedule and clipping. Build it on every rank of an initialised process
    group with the same arguments.

    Args:
        model: a transformers config (random init from ``seed``) or a local ``save_pretrained`` directory.
        role: ``"policy"`` (:class:`CausalLMPolicy`: chunked log-probs) or ``"value"``
            (:class:`CausalLMValue` on the same base).
        precision: ``"bf16"`` (mixed precision) or ``"fp32"``; default bf16 on CUDA, fp32 on the CPU.
        activation_checkpointing: recompute each decoder layer in the backward.
        chunk_tokens: token positions per chunk of logits (policy).
        optimizer, lr, weight_decay, betas: see :func:`~integrations.rl.optim.build_optimizer`.
        warmup_steps, lr_decay, total_steps, min_lr_ratio: see :func:`~integrations.rl.optim.lr_schedule`
            (the step's rate is the ``lr`` of its metrics).
        max_grad_norm: clip bound (None: measure only).
        seed: initial weights of a config's model, and of a critic's head.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; the current device).
        value_shift, report_entropy: see :class:`~integrations.rl.workers.base.RLWorkerMixin`.
    """

    chunked_logprobs = True

    def __init__(
        self,
        model: Source,
        *,
        role: Literal["policy", "value"] = "policy",
        precision: Literal["bf16", "fp32"] | None = None,
        activation_checkpointing: bool = False,
        chunk_tokens: int = 1024,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_decay: Literal["constant", "cosine"] = "constant",
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        max_grad_norm: float | None = 1.0,
        seed: int = 0,
        device: str = "cpu",
        value_shift: bool = True,
        report_entropy: bool = True,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise InvalidArgument("initialise torch.distributed (init_process_group) on every rank before the worker")
        if role not in ("policy", "value"):
            raise InvalidArgument(f"role must be 'policy' or 'value', got {role!r}")
        self.device_mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("dp",))
        self.precision = precision or ("bf16" if device != "cpu" else "fp32")
        if role == "policy":
            module: nn.Module = CausalLMPolicy(load_causal_lm(model, seed=seed), chunk_tokens=chunk_tokens)
        else:
            module = CausalLMValue(load_causal_lm(model, seed=seed, base_only=True), seed=seed + 1)
        if device != "cpu":
            module = module.to(device)
        self.model = shard_hf_model(
            module, self.device_mesh, precision=self.precision, activation_checkpointing=activation_checkpointing
        )
        self.optimizer = build_optimizer(
            self.model.parameters(), name=optimizer, lr=lr, weight_decay=weight_decay, betas=betas
        )
        self.lr_scheduler = lr_schedule(
            self.optimizer,
            warmup_steps=warmup_steps,
            decay=lr_decay,
            total_steps=total_steps,
            min_lr_ratio=min_lr_ratio,
        )
        self.role = role
        self.max_grad_norm = max_grad_norm
        self.value_shift = value_shift
        self.report_entropy = report_entropy and role == "policy"
