"""GRPO on text: a tiny Qwen2 model (random init) learns sums with transformers' generate as the
rollout engine, a tokenizer, and a math-answer reward, over the data plane, on a laptop CPU.

    python -m integrations.rl.examples.grpo_text                     # "3+4=" -> "7", 200 steps, 2 DP ranks
    python -m integrations.rl.examples.grpo_text --transport inline  # the same run, tensors through the driver
    python -m integrations.rl.examples.grpo_text --task gsm8k.jsonl --tokenizer ./my_tokenizer

The task (``--task arithmetic``): prompts ``"a+b="`` with operands 0..9 drawn from the seed, a
character-level tokenizer built here (``--tokenizer DIR`` loads any local one), and the reward of
:func:`~integrations.rl.rewards.math_reward`: 1 when the completion's last number is the sum, else 0.
``--task FILE`` reads a GSM8K-format JSONL file instead (``question``, ``answer`` ending ``#### N``;
the last ``--eval-prompts`` records are held out). The rollout actor samples with an
:class:`~integrations.rl.engines.HFEngine` (``--engine torch`` samples with the KV-cached torch
sampler instead); the weights reach it by name after every step. Every ``--eval-every`` steps the
rollout actor decodes the held-out prompts greedily and the step line shows the accuracy; every step
reports ``sampler_logprob_diff`` (the engine's log-probs against the trainer's for the same tokens).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from integrations.rl.examples.common import Cluster, Options, run

__all__ = ["DEFAULTS", "Cluster", "Options", "main", "run"]

DEFAULTS = Options(
    algorithm="grpo",
    model="qwen2",
    engine="hf",
    task_name="arithmetic",
    steps=200,
    prompts_per_step=32,
    group_size=16,
    max_new_tokens=3,
    lr=3e-3,
    kl_coef=0.0,
    eval_every=20,
    eval_prompts=64,
)


def main(argv: Sequence[str] | None = None) -> int:
    from integrations.rl.examples import cli

    return cli.main(argv, defaults=DEFAULTS, module="integrations.rl.examples.grpo_text", doc=__doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
