"""Plot a run's TensorBoard scalars (read back from its event files) as one PNG grid.

    python scripts/plot_tensorboard.py RUN_DIR OUT.png

The docs' picture of a run (docs/rl/observability.md) is drawn this way, with matplotlib, from the
event files ``--tensorboard RUN_DIR`` wrote: the same numbers TensorBoard's own board shows.
"""

from __future__ import annotations

import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(run_dir: str, out: str) -> None:
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    cols = 4
    rows = math.ceil(len(tags) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.4 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, tags, strict=False):
        events = acc.Scalars(tag)
        ax.plot([e.step + 1 for e in events], [e.value for e in events], marker=".", linewidth=1)
        ax.set_title(tag, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tags) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"wrote {out}: {len(tags)} scalars")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
