"""The examples' command line: flags over an algorithm's defaults, and the one-line summary."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from dataplane import InvalidArgument
from integrations.rl.examples import models
from integrations.rl.examples.common import Options, run

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None, *, defaults: Options, module: str, doc: str) -> Options:
    """The example's command line over ``defaults`` (its algorithm's settings)."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    p.add_argument("--steps", type=int, default=defaults.steps, help=f"steps (default {defaults.steps})")
    p.add_argument(
        "--model",
        choices=models.MODELS,
        default=defaults.model,
        help=f"tiny (pure torch) or a Hugging Face architecture at a tiny size, random init (default {defaults.model})",
    )
    p.add_argument(
        "--task",
        default=defaults.task_name,
        metavar="NAME|FILE",
        help=f"{' or '.join(models.TASKS)}, or a GSM8K-format JSONL file (default {defaults.task_name})",
    )
    p.add_argument(
        "--engine",
        choices=["torch", "hf"],
        default=defaults.engine,
        help=f"the rollout engine: torch (a KV-cached sampler over the model) or hf (transformers' generate; "
        f"--model qwen2/llama) (default {defaults.engine})",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="a local tokenizer directory for text tasks (default: built here)"
    )
    p.add_argument("--max-operand", type=int, default=defaults.max_operand, help="arithmetic task: operands 0..N")
    p.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    p.add_argument("--group-size", type=int, default=defaults.group_size, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--temperature", type=float, default=defaults.temperature)
    p.add_argument(
        "--eval-every",
        type=int,
        default=defaults.eval_every,
        metavar="K",
        help="greedy held-out accuracy every K steps and at the start (0: never)",
    )
    p.add_argument("--eval-prompts", type=int, default=defaults.eval_prompts, help="held-out prompts per evaluation")
    p.add_argument("--backend", default="mooncake://local", help="data plane URL (default mooncake://local)")
    if defaults.algorithm != "grpo_async":
        p.add_argument("--transport", choices=["dataplane", "inline"], default="dataplane")
    p.add_argument("--train-step", choices=["split", "monolithic"], default="split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, default=2, help="data-parallel trainer ranks (default 2)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (--worker megatron; default 1)")
    p.add_argument(
        "--worker",
        choices=["fsdp2", "megatron"],
        default=defaults.worker,
        help="the trainers' worker for the policy, reference and value models: fsdp2 (FSDP2/DTensor, CPU or "
        f"GPU) or megatron (Megatron-Core; needs --device cuda and dataplane[megatron]) (default {defaults.worker})",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the trainer ranks compute: cpu (gloo, default) or cuda (a GPU per rank, NCCL); "
        "the rollout actor samples on the CPU either way",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate (default {defaults.lr:g} for --model {defaults.model}; else 1e-2 tiny, 3e-2 qwen2/llama)",
    )
    p.add_argument("--kl-coef", type=float, default=defaults.kl_coef)
    if defaults.algorithm == "ppo":
        p.add_argument("--value-lr", type=float, default=defaults.value_lr)
        p.add_argument(
            "--no-value-shift",
            action="store_true",
            help="ablation: keep the value head's output at t where it is (one token late) instead of shifting it right",
        )
    p.add_argument(
        "--rollout-latency",
        type=float,
        default=0.0,
        metavar="S",
        help="idle seconds added to every rollout call: an inference engine on hardware of its own (default 0)",
    )
    if defaults.algorithm == "grpo_async":
        p.add_argument(
            "--max-staleness",
            type=int,
            default=defaults.max_staleness,
            metavar="K",
            help=f"train groups sampled at most K versions ago (default {defaults.max_staleness})",
        )
        p.add_argument(
            "--capacity",
            type=int,
            default=None,
            help="replay buffer slots, reserved or committed (default (K + 1) x prompts per step)",
        )
        p.add_argument("--in-order", action="store_true", help="train groups in the order their prompts were issued")
        p.add_argument("--rollout-actors", type=int, default=defaults.rollout_actors)
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save the run here (trainers' state, step, versions; asynchronous runs: the replay buffer's rows too)",
    )
    p.add_argument("--checkpoint-every", type=int, default=5, metavar="K", help="save every K steps and at the end")
    p.add_argument("--keep", type=int, default=2, help="step directories kept (the newest; default 2)")
    p.add_argument("--resume", action="store_true", help="go on from the latest checkpoint in --checkpoint-dir")
    if defaults.algorithm != "grpo_async":
        p.add_argument(
            "--max-restarts",
            type=int,
            default=0,
            metavar="N",
            help="replace the actors up to N times when one dies, going on from the latest checkpoint",
        )
    p.add_argument("--log-dir", metavar="DIR", help="append each step's summary to DIR/steps.jsonl")
    p.add_argument(
        "--tensorboard", metavar="DIR", help="TensorBoard scalars of every step in DIR (and DIR/steps.jsonl)"
    )
    p.add_argument("--json", metavar="PATH", help="write the run here")
    a = p.parse_args(argv)
    ppo, asynchronous = defaults.algorithm == "ppo", defaults.algorithm == "grpo_async"
    return replace(
        defaults,
        max_staleness=a.max_staleness if asynchronous else defaults.max_staleness,
        capacity=a.capacity if asynchronous else defaults.capacity,
        in_order=a.in_order if asynchronous else defaults.in_order,
        rollout_actors=a.rollout_actors if asynchronous else defaults.rollout_actors,
        rollout_latency=a.rollout_latency,
        value_lr=a.value_lr if ppo else defaults.value_lr,
        value_shift=not a.no_value_shift if ppo else True,
        steps=a.steps,
        model=a.model,
        task_name=a.task,
        engine=a.engine,
        tokenizer=a.tokenizer,
        max_new_tokens=a.max_new_tokens,
        max_operand=a.max_operand,
        prompts_per_step=a.prompts_per_step,
        group_size=a.group_size,
        temperature=a.temperature,
        eval_every=a.eval_every,
        eval_prompts=a.eval_prompts,
        backend=a.backend,
        transport=getattr(a, "transport", "dataplane"),
        train_step=a.train_step,
        seed=a.seed,
        dp=a.dp,
        tp=a.tp,
        pp=a.pp,
        worker=a.worker,
        device=a.device,
        lr=a.lr if a.lr is not None else defaults.lr if a.model == defaults.model else None,
        kl_coef=a.kl_coef,
        json=a.json,
        log_dir=a.log_dir,
        tensorboard=a.tensorboard,
        checkpoint_dir=getattr(a, "checkpoint_dir", None),
        checkpoint_every=getattr(a, "checkpoint_every", 5),
        keep=getattr(a, "keep", 2),
        resume=getattr(a, "resume", False),
        max_restarts=getattr(a, "max_restarts", 0),
    )


def main(argv: Sequence[str] | None, *, defaults: Options, module: str, doc: str) -> int:
    """Run the example from the command line; 2 on bad arguments."""
    try:
        opts = parse_args(argv, defaults=defaults, module=module, doc=doc)
        result = run(opts)
    except InvalidArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first, last3 = result["steps"][0]["reward_mean"], result["steps"][-3:]
    tail = sum(s["reward_mean"] for s in last3) / len(last3)
    if opts.transport == "inline":
        moved = "no data plane: the tensors went through the driver"
    else:
        share = result["driver_bytes_get"] / result["bytes_get"] if result["bytes_get"] else 0.0
        who = "controller" if opts.algorithm == "grpo_async" else "driver"
        moved = f"the {who} read {result['driver_bytes_get']} of the {result['bytes_get']} bytes read ({share:.2%})"
    if opts.algorithm == "grpo_async":
        moved += f"; trained rows at most {result['max_trained_staleness']} versions stale"
    ranks = f"{opts.ranks} {'GPU' if opts.device == 'cuda' else 'CPU'} trainer ranks"
    ranks += ", Megatron" if opts.worker == "megatron" else ""
    moved += (
        f"; per trainer over the steps ({ranks}): data {result['trainer_data_seconds']:.2f} s, "
        f"compute {result['trainer_compute_seconds']:.2f} s"
    )
    print(
        f"reward {first:.3f} -> {tail:.3f} (mean of the last {len(last3)} steps) in {result['total_seconds']:.1f} s; "
        f"params sha256 {result['param_sha256'][:16]}..., norm {result['param_norm']:.6f}; {moved}"
    )
    evals = [s for s in result["steps"] if "eval_accuracy" in s]
    if evals and "eval_initial" in result:
        start = result["eval_initial"]["eval_accuracy"]
        print(
            f"held-out accuracy {start:.3f} -> {evals[-1]['eval_accuracy']:.3f} ({opts.eval_prompts} prompts, greedy)"
        )
    if opts.json:
        print(f"wrote {opts.json}")
    return 0
