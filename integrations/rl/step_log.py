"""Per-step logs of an RL run: JSON lines always, TensorBoard scalars when asked.

:class:`StepLogger` takes each step's summary (:meth:`StepRecord.summary
<integrations.rl.sync_loop.StepRecord.summary>`, the asynchronous record's too) and writes

* one JSON object per line to ``steps.jsonl`` (every field of the summary, as is);
* with ``tensorboard=True``, a scalar per figure (TensorBoard's own event files, through
  ``torch.utils.tensorboard``; needs ``pip install tensorboard``), named by :data:`SCALARS`: reward
  (mean, std, max), the policy's loss, KL, gradient norm, learning rate, entropy and share of real
  tokens, the value model's loss and explained variance (PPO), staleness and buffer occupancy
  (asynchronous), the step's time split into rollout, training, data plane, trainer data and compute,
  and weight sync, and the bytes moved with the driver's share. A figure a step does not have (KL
  without a KL penalty, staleness of a synchronous run) is not written for it.

>>> import json, tempfile
>>> d = Path(tempfile.mkdtemp())
>>> with StepLogger(d) as log:
...     log.log({"step": 0, "reward_mean": 0.5})
>>> json.loads((d / "steps.jsonl").read_text())["reward_mean"]
0.5
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["SCALARS", "StepLogger"]

#: summary field -> TensorBoard tag
SCALARS: dict[str, str] = {
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "reward_max": "reward/max",
    "loss": "policy/loss",
    "kl": "policy/kl",
    "grad_norm": "policy/grad_norm",
    "lr": "policy/lr",
    "entropy": "policy/entropy",
    "real_token_share": "policy/real_token_share",
    "value_loss": "value/loss",
    "explained_variance": "value/explained_variance",
    "staleness_max": "async/staleness_max",
    "staleness_mean": "async/staleness_mean",
    "buffer_occupancy": "async/buffer_occupancy",
    "seconds": "time/step",
    "rollout_seconds": "time/rollout",
    "train_seconds": "time/train",
    "data_plane_seconds": "time/data_plane",
    "trainer_data_seconds": "time/trainer_data",
    "trainer_compute_seconds": "time/trainer_compute",
    "weight_sync_seconds": "time/weight_sync",
    "bytes_put": "bytes/put",
    "bytes_get": "bytes/get",
    "driver_bytes_share": "bytes/driver_share",
    "rows_trained": "rows/trained",
    "dropped_groups": "rows/dropped_groups",
}


class StepLogger:
    """Writes step summaries under ``directory``: ``steps.jsonl`` (appended, flushed per step) and,
    with ``tensorboard``, TensorBoard event files. Use it as a context manager or :meth:`close` it."""

    def __init__(self, directory: str | os.PathLike[str], *, tensorboard: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.directory / "steps.jsonl", "a")  # noqa: SIM115 - closed in close()
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("TensorBoard logs need tensorboard: pip install tensorboard") from e
            self._writer = SummaryWriter(log_dir=str(self.directory))

    def log(self, summary: Mapping[str, Any]) -> None:
        """One step's summary (``summary["step"]`` is its 0-based index)."""
        self._jsonl.write(json.dumps(dict(summary), default=str) + "\n")
        self._jsonl.flush()
        if self._writer is None:
            return
        step = int(summary["step"])
        for key, tag in SCALARS.items():
            value = summary.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(tag, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the files (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self._jsonl.closed:
            self._jsonl.close()

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
