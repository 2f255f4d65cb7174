"""GRPO on a tiny model that learns to keep counting, over the data plane, on a laptop CPU.

    python -m integrations.rl.examples.grpo_tiny --steps 20
    python -m integrations.rl.examples.grpo_tiny --backend "tq://?backend=simple" --json run.json
    python -m integrations.rl.examples.grpo_tiny --transport inline   # the same run, tensors through the driver
    python -m integrations.rl.examples.grpo_tiny --device cuda        # trainer ranks on 2 GPUs over NCCL

The task: a prompt of 4 consecutive tokens, counting through ``1..7`` (``3 4 5 6``); the reward is
the share of the next 4 sampled tokens that keep counting (``7 1 2 3`` scores 1.0, token 0 ends a
response). A rollout actor samples 8 responses for each of 16 prompts per step; ``dp * tp`` FSDP2
trainer actors (gloo on CPU) train the policy with :class:`~integrations.rl.grpo.GRPO`; the rows go
through the data plane (``--backend``), never through this driver. ``--transport inline`` runs the
same algorithm, plan and seeds with the tensors passed through the driver as Ray object refs, and
ends with the same parameters bit for bit.

``--device cuda`` puts each trainer rank on a GPU of its own (NCCL; the rollout actor still samples
on the CPU and gets the weights as CPU tensors).

Each step prints the mean reward, the KL to the initial model, the loss, the step time, the time
spent in data-plane calls (summed over every process), and per trainer rank the seconds its step
calls spent moving data against computing; ``--json`` writes the run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from integrations.rl.examples.common import Cluster, Options, run

__all__ = ["DEFAULTS", "Cluster", "Options", "main", "run"]

DEFAULTS = Options(algorithm="grpo")


def main(argv: Sequence[str] | None = None) -> int:
    from integrations.rl.examples import cli

    return cli.main(argv, defaults=DEFAULTS, module="integrations.rl.examples.grpo_tiny", doc=__doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
