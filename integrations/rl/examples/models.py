"""What an example trains and samples with: the model (``--model``: the tiny pure-torch model, or a
Hugging Face architecture, Qwen2 or Llama, at a tiny size, built from a config with random weights,
so that every example runs on a laptop CPU), the rollout engine (``--engine``) and the task
(``--task``). The trainers get FSDP2 workers; the rollout actor samples with an unsharded copy of
the same model (weights synced by name after every step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from dataplane import InvalidArgument
from integrations.rl.workers.base import RLWorkerMixin
from integrations.rl.workers.model import TinyConfig
from integrations.rl.workers.tiny import TinyDTensorWorker

__all__ = [
    "MODELS",
    "TASKS",
    "build_task",
    "default_lr",
    "hf_config",
    "megatron_factories",
    "model_vocab",
    "rollout_model",
    "worker_factories",
]

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


def hf_config(family: str, vocab_size: int, max_positions: int = 32) -> Any:
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
        max_positions=max_positions,
        initializer_range=0.1,
    )


def _hf_policy(family: str, vocab_size: int, seed: int, max_positions: int = 32) -> nn.Module:
    from integrations.rl.workers.hf import CausalLMPolicy, load_causal_lm

    return CausalLMPolicy(load_causal_lm(hf_config(family, vocab_size, max_positions), seed=seed))


def _hf_engine(family: str, vocab_size: int, seed: int, max_positions: int, pad_token_id: int) -> Any:
    from integrations.rl.engines import HFEngine

    return HFEngine(_hf_policy(family, vocab_size, seed, max_positions), pad_token_id=pad_token_id)


#: ``--task`` choices besides a GSM8K-format JSONL file.
TASKS = ("counting", "arithmetic")


def build_task(opts: Any) -> Any:
    """The run's task: the counting toy, synthetic sums (``arithmetic``), or a GSM8K-format JSONL file
    (``--task PATH``: the last ``--eval-prompts`` records are held out). Text tasks tokenize with
    ``--tokenizer DIR`` (any local tokenizer) or a character-level tokenizer built here."""
    from integrations.rl.rollout import CountingTask

    if opts.task_name == "counting":
        return CountingTask(vocab_size=opts.vocab_size, prompt_len=4, target_len=opts.target_len)
    from integrations.rl import tasks

    tokenizer = None if opts.tokenizer is None else tasks.load_tokenizer(opts.tokenizer)
    if opts.task_name == "arithmetic":
        return tasks.arithmetic_task(
            seed=opts.seed, max_operand=opts.max_operand, eval_size=opts.eval_prompts, tokenizer=tokenizer
        )
    records = tasks.load_gsm8k(opts.task_name)
    if len(records) <= opts.eval_prompts:
        raise InvalidArgument(
            f"{opts.task_name} has {len(records)} records; it needs more than --eval-prompts {opts.eval_prompts}"
        )
    if tokenizer is None:
        text = "".join(str(r.prompt) + r.answer for r in records)
        tokenizer = tasks.char_tokenizer("".join(sorted(set(text))))
    train, held_out = records[: -opts.eval_prompts], records[-opts.eval_prompts :]
    return tasks.TextTask(train, held_out, tokenizer)


def model_vocab(opts: Any, task: Any) -> int:
    """The models' vocabulary: ``--vocab-size`` for the counting task, the tokenizer's size for text."""
    return int(opts.vocab_size if opts.task_name == "counting" else task.vocab_size)


def _max_positions(opts: Any) -> int:
    return 32 if opts.task_name == "counting" else 1024


def rollout_model(opts: Any, task: Any = None) -> Any:
    """What the rollout actor samples with (picklable): a tiny model's config, or a factory of the
    HF model (``--engine torch``: :class:`~integrations.rl.engines.TorchEngine`) or of an
    :class:`~integrations.rl.engines.HFEngine` (``--engine hf``)."""
    task = task if task is not None else build_task(opts)
    vocab = model_vocab(opts, task)
    if opts.model == "tiny":
        if opts.engine == "hf":
            raise InvalidArgument("--engine hf samples with transformers' generate: use --model qwen2 or llama")
        return tiny_shape(vocab)
    if opts.engine == "hf":
        pad = getattr(getattr(task, "tokenizer", None), "pad_token_id", None) or 0
        return functools.partial(_hf_engine, opts.model, vocab, opts.seed, _max_positions(opts), int(pad))
    return functools.partial(_hf_policy, opts.model, vocab, opts.seed, _max_positions(opts))


def worker_factories(opts: Any) -> dict[str, Callable[[], RLWorkerMixin]]:
    """The trainer ranks' models: the policy, a frozen reference from the same seed when there is a
    KL penalty, and for PPO a value model; built on ``opts.device`` (on CUDA, the rank's current device)."""
    on: dict[str, Any] = {} if opts.device == "cpu" else {"device": opts.device}
    value_kw = {"lr": opts.value_lr, "value_shift": opts.value_shift, **on}
    if opts.model == "tiny":
        shape = tiny_shape(model_vocab(opts, build_task(opts)))
        policy: Callable[[], RLWorkerMixin] = functools.partial(
            TinyDTensorWorker, shape, tp=opts.tp, lr=opts.lr, seed=opts.seed, **on
        )
        value: Callable[[], RLWorkerMixin] = functools.partial(
            TinyDTensorWorker, replace(shape, head="value"), tp=opts.tp, seed=opts.seed + 1, **value_kw
        )
        if getattr(opts, "worker", "fsdp2") == "megatron":  # the same model on Megatron-Core (--worker)
            policy, value = megatron_factories(opts, shape)
    else:
        from integrations.rl.workers.hf import HFCausalLMWorker

        if opts.tp != 1:
            raise InvalidArgument(f"--model {opts.model} trains with FSDP2 over DP only; drop --tp {opts.tp}")
        cfg = hf_config(opts.model, model_vocab(opts, build_task(opts)), _max_positions(opts))
        # fp32 everywhere: the CPU runs compare bits with the inline transport, and the rollout samples in fp32
        policy = functools.partial(HFCausalLMWorker, cfg, lr=opts.lr, seed=opts.seed, precision="fp32", **on)
        value = functools.partial(HFCausalLMWorker, cfg, role="value", seed=opts.seed, precision="fp32", **value_kw)
    out = {"policy": policy}
    if opts.kl_coef > 0:
        out["reference"] = policy
    if opts.algorithm == "ppo":
        out["value"] = value
    return out


def megatron_factories(opts: Any, shape: TinyConfig) -> tuple[Callable[[], RLWorkerMixin], Callable[[], RLWorkerMixin]]:
    """``--worker megatron``: the policy and the value model as
    :class:`~integrations.rl.workers.megatron_tiny.TinyMegatronWorker` (Megatron-Core on CUDA, TP and PP
    from ``--tp`` / ``--pp``): the FSDP2 workers' model with their initial weights (``init="tiny"``, the
    same seeds) and optimizer settings (Adam, no weight decay, gradients clipped at 1.0). Their weights
    reach the rollout's tiny model under its names."""
    from integrations.rl.workers.megatron_tiny import TinyMegatronWorker

    common = {"tp": opts.tp, "pp": opts.pp, "optimizer": "adam", "clip_grad": 1.0, "init": "tiny"}
    policy = functools.partial(TinyMegatronWorker, shape, lr=opts.lr, seed=opts.seed, **common)
    value = functools.partial(
        TinyMegatronWorker,
        replace(shape, head="value"),
        lr=opts.value_lr,
        seed=opts.seed + 1,
        value_shift=opts.value_shift,
        **common,
    )
    return policy, value
