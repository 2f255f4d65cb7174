"""Asynchronous GRPO on the tiny counting task: rollouts sample with weights up to K steps old while
the trainers train, through a replay buffer of whole groups.

    python -m integrations.rl.examples.grpo_async_tiny --steps 20 --max-staleness 1
    python -m integrations.rl.examples.grpo_async_tiny --max-staleness 0   # trains what grpo_tiny trains
    python -m integrations.rl.examples.grpo_async_tiny --in-order --capacity 24 --rollout-actors 2 --json run.json

The task, model, trainers and algorithm are :mod:`~integrations.rl.examples.grpo_tiny`'s. A
single controller actor (:class:`~integrations.rl.controller.AsyncGRPO`, CPU only) runs a rollout
pump per rollout actor and the train pump; this driver asks it for one step at a time. Each step
prints, beside the synchronous example's figures, the staleness of the trained rows (``max/mean``
of ``version - weight_version``), the buffer's occupancy, how long the trainer waited for rollouts
and how long the rollout actors waited for the trainer. ``--json`` writes the run, with
``max_trained_staleness`` over every trained row.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from integrations.rl.examples.common import Cluster, Options, run

__all__ = ["DEFAULTS", "Cluster", "Options", "main", "run"]

DEFAULTS = Options(algorithm="grpo_async")


def main(argv: Sequence[str] | None = None) -> int:
    from integrations.rl.examples import cli

    return cli.main(argv, defaults=DEFAULTS, module="integrations.rl.examples.grpo_async_tiny", doc=__doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
