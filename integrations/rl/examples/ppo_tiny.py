"""PPO with a value model on the tiny counting task, over the data plane, on a laptop CPU.

    python -m integrations.rl.examples.ppo_tiny --steps 20
    python -m integrations.rl.examples.ppo_tiny --no-value-shift      # ablation: values one token late
    python -m integrations.rl.examples.ppo_tiny --transport inline    # the same run, tensors through the driver

The task and the rollout are the GRPO example's (``grpo_tiny``). The trainer actors hold a policy
and a value model (two tiny transformers, the value one with a scalar head); per step the value
model writes token-aligned ``values`` (its output at ``t - 1``, shifted right), the trainers run
GAE on their shards and write ``advantages`` and ``returns``, then two epochs of two minibatches
train both models (:class:`~integrations.rl.ppo.PPO`). Each step prints the reward, the policy
loss, the value loss and the explained variance of the values; ``--json`` writes the run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from integrations.rl.examples.common import Cluster, Options, run

__all__ = ["DEFAULTS", "Cluster", "Options", "main", "run"]

DEFAULTS = Options(algorithm="ppo", kl_coef=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    from integrations.rl.examples import cli

    return cli.main(argv, defaults=DEFAULTS, module="integrations.rl.examples.ppo_tiny", doc=__doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
