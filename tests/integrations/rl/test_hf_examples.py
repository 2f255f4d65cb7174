"""The RL examples on a Hugging Face architecture (``--model qwen2``): a tiny random-init Qwen2 trained
by two FSDP2 trainer actors (gloo) on a real local Ray, sampled by a rollout actor with a copy of the
same model, rows through a real ``mooncake://local``; the same run with the tensors through the driver
ends with the same bits. The 20-step command that learns is a soak test (about a minute).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rl_checks import run_example

import dataplane
from integrations.rl.examples import grpo_tiny

pytest.importorskip("transformers", reason="needs transformers: pip install 'dataplane[hf]'")
pytest.importorskip("ray", reason="needs Ray: pip install 'dataplane[tq]'")
pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.mooncake]

OPTS = grpo_tiny.Options(model="qwen2", steps=3, prompts_per_step=4, group_size=4, seed=2, progress=False)


@pytest.mark.timeout(400)
def test_qwen2_dataplane_run_equals_the_inline_run_bit_for_bit(ray_cluster: None) -> None:
    with dataplane.connect("mooncake://local") as owner:
        cluster = grpo_tiny.Cluster.start(OPTS)
        try:
            inline = grpo_tiny.run(replace(OPTS, transport="inline"), cluster=cluster)
            through = grpo_tiny.run(OPTS, cluster=cluster, client=owner)
        finally:
            cluster.shutdown()
    assert through["options"]["model"] == "qwen2" and through["options"]["lr"] == 3e-2
    assert through["param_sha256"] == inline["param_sha256"]
    assert [s["reward_mean"] for s in through["steps"]] == [s["reward_mean"] for s in inline["steps"]]
    assert through["bytes_get"] > 0 and through["driver_bytes_get"] == 0 and inline["bytes_get"] == 0
    first = through["steps"][-1]
    assert 0 < first["entropy"] <= 2.1 and 0 < first["real_token_share"] <= 1, first  # log(8) = 2.08


def _example(tmp_path: Path, *args: str) -> dict[str, Any]:
    return run_example("grpo_tiny", tmp_path, *args, timeout_s=600)


@pytest.mark.soak
def test_the_qwen2_example_learns_and_equals_its_inline_run(tmp_path: Path) -> None:
    """The command a user runs, 20 steps: the counting task learned by the same clear margin as the
    tiny model's, and the inline transport ends with the same parameters."""
    doc = _example(tmp_path, "--model", "qwen2", "--steps", "20")
    first, last3 = doc["steps"][0]["reward_mean"], [s["reward_mean"] for s in doc["steps"][-3:]]
    assert sum(last3) / 3 > first + 0.25, [s["reward_mean"] for s in doc["steps"]]
    inline = _example(tmp_path, "--model", "qwen2", "--steps", "20", "--transport", "inline")
    assert inline["param_sha256"] == doc["param_sha256"]
