"""The models an example trains (``--model``): the tiny pure-torch model, or a Hugging Face
architecture (Qwen2, Llama) at a tiny size, built from a config with random weights, so that every
example runs on a laptop CPU. The trainers get FSDP2 workers; the rollout actor samples with an
unsharded copy of the same model (weights synced by name after every step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from integrations.rl.workers.base import RLWorkerMixin
from integrations.rl.workers.model import TinyConfig
from integrations.rl.workers.tiny import TinyDTensorWorker

__all__ = ["MODELS", "default_lr", "hf_config", "rollout_model", "worker_factories"]

#: ``--model`` choices.
MODELS = ("tiny", "qwen2", "llama")


def tiny_shape(vocab_size: int) -> TinyConfig:
    return TinyConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, max_len=32)


def default_lr(model: str) -> float:
    """The examples' learning rate for ``model`` (AdamW; measured to learn the counting task in 20 steps).

    >>> default_lr("tiny"), default_lr("qwen2")
    (0.01, 0.03)
    """
    return 1e-2 if model == "tiny" else 3e-2


def hf_config(family: str, vocab_size: int) -> Any:
    """A tiny config of ``family`` the size of the tiny model: width 32, 2 layers, 4 heads (2 KV heads).

    Weights start at ``initializer_range=0.1`` (transformers' default is 0.02, made for widths in the
    thousands): at width 32 that start learned the counting task in 20 steps in 1 of 6 seeded runs
    against 6 of 6 at 0.1 (Qwen2, seeds 0-2, learning rates 2e-2 and 3e-2).
    """
    from integrations.rl.workers.hf import tiny_config

    return tiny_config(
        family,
        vocab_size=vocab_size,
        hidden_size=32,
        num_layers=2,
        intermediate_size=64,
        max_positions=32,
        initializer_range=0.1,
    )


def _hf_policy(family: str, vocab_size: int, seed: int) -> nn.Module:
    from integrations.rl.workers.hf import CausalLMPolicy, load_causal_lm

    return CausalLMPolicy(load_causal_lm(hf_config(family, vocab_size), seed=seed))


def rollout_model(opts: Any) -> TinyConfig | Callable[[], nn.Module]:
    """What the rollout actor builds its sampling model from (picklable)."""
    if opts.model == "tiny":
        return tiny_shape(opts.vocab_size)
    return functools.partial(_hf_policy, opts.model, opts.vocab_size, opts.seed)


def worker_factories(opts: Any) -> dict[str, Callable[[], RLWorkerMixin]]:
    """The trainer ranks' models: the policy, a frozen reference from the same seed when there is a
    KL penalty, and for PPO a value model; built on ``opts.device`` (on CUDA, the rank's current device)."""
    on: dict[str, Any] = {} if opts.device == "cpu" else {"device": opts.device}
    value_kw = {"lr": opts.value_lr, "value_shift": opts.value_shift, **on}
    if opts.model == "tiny":
        shape = tiny_shape(opts.vocab_size)
        policy: Callable[[], RLWorkerMixin] = functools.partial(
            TinyDTensorWorker, shape, tp=opts.tp, lr=opts.lr, seed=opts.seed, **on
        )
        value: Callable[[], RLWorkerMixin] = functools.partial(
            TinyDTensorWorker, replace(shape, head="value"), tp=opts.tp, seed=opts.seed + 1, **value_kw
        )
    else:
        from integrations.rl.workers.hf import HFCausalLMWorker

        if opts.tp != 1:
            from dataplane import InvalidArgument

            raise InvalidArgument(f"--model {opts.model} trains with FSDP2 over DP only; drop --tp {opts.tp}")
        cfg = hf_config(opts.model, opts.vocab_size)
        # fp32 everywhere: the CPU runs compare bits with the inline transport, and the rollout samples in fp32
        policy = functools.partial(HFCausalLMWorker, cfg, lr=opts.lr, seed=opts.seed, precision="fp32", **on)
        value = functools.partial(HFCausalLMWorker, cfg, role="value", seed=opts.seed, precision="fp32", **value_kw)
    out = {"policy": policy}
    if opts.kl_coef > 0:
        out["reference"] = policy
    if opts.algorithm == "ppo":
        out["value"] = value
    return out
