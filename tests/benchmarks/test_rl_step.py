"""``benchmarks.rl_step --quick`` in this process, on the test process's Ray (``ray_cluster``): the
driver funnel and ``mooncake://local``, every phase timed, what the trainers read checked against the
rollout's rows inside the benchmark (which raises otherwise).

To fit CI this run leaves out the benchmark's own Ray start and the ``tq://`` backends (a
TransferQueue deployment each; the step's code is the same for every backend); the whole ``--quick``
command, every installed backend in a process of its own, is the soak test in
``test_docs_and_bench.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="needs Ray: pip install 'dataplane[tq]'")
pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.tq, pytest.mark.mooncake]  # tq: Ray

URLS = ["mooncake://local"]


def check_report(report: dict[str, Any], md: str, urls: list[str]) -> None:
    """What every ``rl_step`` report holds: a contender per URL after the funnel, every phase timed, the
    funnel's driver bytes at least twice the batch and every data plane's under 1% of it."""
    from benchmarks.rl_step import FUNNEL, PHASES

    assert [c["name"] for c in report["contenders"]] == [FUNNEL, *urls]
    size = report["contenders"][0]["size_bytes"]
    for c in report["contenders"]:
        assert set(c["phases"]) == set(PHASES) and min(c["phases"].values()) >= 0 and c["step_seconds"] > 0
        assert c["step_seconds"] == pytest.approx(sum(c["phases"].values()), rel=0.5)  # medians of sums
        assert c["speedup_vs_funnel"] > 0 and c["driver_peak_rss_delta_bytes"] >= 0
        if c["name"] == FUNNEL:
            assert c["backend"] is None and c["speedup_vs_funnel"] == 1.0
            assert c["driver_bytes"] >= 2 * size  # the batch in, the shards out, the logprobs back
        else:
            assert c["driver_bytes"] < 0.01 * size  # rewards in, advantages out: per-row scalars
    assert report["machine"]["cpu_count"] == os.cpu_count()
    assert report["command"].startswith("python -m benchmarks.rl_step")
    assert "| vs funnel |" in md and f"`{FUNNEL}`" in md


def test_rl_step_quick_times_the_funnel_and_mooncake(
    ray_cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import rl_step

    out, png = tmp_path / "step.json", tmp_path / "step.png"
    argv = ["--quick", "--no-progress", "--backends", ",".join(URLS), "--json", str(out), "--plot", str(png)]
    assert rl_step.main(argv) == 0
    check_report(json.loads(out.read_text()), out.with_suffix(".md").read_text(), URLS)
    assert png.stat().st_size > 0 and "wrote" in capsys.readouterr().out
