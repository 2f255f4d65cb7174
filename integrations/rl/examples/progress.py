"""The examples' step lines, progress bar and step logs (``--log-dir``, ``--tensorboard``).

>>> _bar(3, 4, width=8)
'[######..] 3/4'
"""

from __future__ import annotations

import sys
from typing import Any

from integrations.rl.step_log import StepLogger

__all__ = ["Progress"]


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def _line(s: dict[str, Any], total: int) -> str:
    def num(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    if "value_loss" in s:  # PPO
        middle = f"value loss {num(s['value_loss'], '.4f')}  explained var {num(s['explained_variance'], '+.3f')}"
    else:
        middle = f"dropped {s['dropped_groups']}/{s['groups']}"
    if "staleness_max" in s:  # asynchronous
        middle += (
            f"  stale {s['staleness_max']}/{s['staleness_mean']:.2f}  buffer {s['buffer_occupancy']}  "
            f"waits rollout {s['rollout_wait_seconds']:.2f} s train {s['train_wait_seconds']:.2f} s"
        )
    if "eval_accuracy" in s:
        middle += f"  held-out acc {s['eval_accuracy']:.3f}"
    return (
        f"step {s['step'] + 1:>3}/{total}  reward {s['reward_mean']:.3f}  kl {num(s['kl'], '.4f')}  "
        f"loss {num(s['loss'], '+.4f')}  {middle}  {s['seconds']:.2f} s (data plane {s['data_plane_seconds']:.3f} s; "
        f"per trainer: data {s['trainer_data_seconds']:.3f} s, compute {s['trainer_compute_seconds']:.3f} s)"
    )


class Progress:
    """Step lines to ``out``; a progress bar on stderr when it is a terminal; the step logs
    (``--log-dir``, ``--tensorboard``: :class:`~integrations.rl.step_log.StepLogger`)."""

    def __init__(self, opts: Any, out: Any) -> None:
        self.opts, self.out, self.done_steps = opts, out, 0
        self.tty = opts.progress and sys.stderr.isatty()
        where = opts.tensorboard or opts.log_dir
        self.logger = None if where is None else StepLogger(where, tensorboard=opts.tensorboard is not None)

    def step(self, summary: dict[str, Any]) -> None:
        self.done_steps += 1
        if self.logger is not None:
            self.logger.log(summary)
        if not self.opts.progress:
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
        print(_line(summary, self.opts.steps), file=self.out, flush=True)
        if self.tty:
            sys.stderr.write(_bar(self.done_steps, self.opts.steps))
            sys.stderr.flush()

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()

    def done(self) -> None:
        self.close()
        if self.tty:
            sys.stderr.write("\r\033[K")
