"""Crash and resume: an example run killed with SIGKILL (the driver and every process it started: its
Ray, its Mooncake master, the trainer and rollout actors) after a checkpoint, then ``--resume``d, ends
with the same parameters and per-step rewards as the run that was never killed.

The commands are the ones a user runs, each in a fresh process group. Short GRPO and asynchronous GRPO
cases run in CI; the 10 + 10 step GRPO, PPO and asynchronous GRPO cases are soak tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="needs Ray: pip install 'dataplane[tq]'")
pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.mooncake]


def _command(example: str, steps: int, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        f"integrations.rl.examples.{example}",
        "--steps",
        str(steps),
        "--json",
        str(out),
        *extra,
    ]


def _run(cmd: list[str]) -> dict[str, Any]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(cmd[cmd.index("--json") + 1])
    doc: dict[str, Any] = json.loads(out.read_text())
    doc["stdout"] = proc.stdout
    return doc


def _kill_after_checkpoint(cmd: list[str], ckpt: Path, step_dir: str, timeout_s: float = 300.0) -> None:
    """Start ``cmd`` and SIGKILL its whole process group once ``latest`` names ``step_dir``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            latest = ckpt / "latest"
            if latest.is_file() and json.loads(latest.read_text())["dir"] == step_dir:
                break
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before its checkpoint {step_dir}"
            time.sleep(0.05)
        else:
            raise AssertionError(f"no checkpoint {step_dir} within {timeout_s} s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started, at once
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def check_resume(tmp_path: Path, example: str, steps: int, every: int) -> None:
    straight = _run(_command(example, steps, tmp_path / "straight.json"))
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every), "--rollout-latency", "0.5"]
    _kill_after_checkpoint(_command(example, steps, tmp_path / "killed.json", *flags), ckpt, f"step_{every:06d}")
    assert not (tmp_path / "killed.json").exists(), "the killed run never finished"
    resumed = _run(_command(example, steps, tmp_path / "resumed.json", *flags, "--resume"))
    assert f"resumed from {ckpt / f'step_{every:06d}'} after step {every}" in resumed["stdout"]
    assert [s["reward_mean"] for s in resumed["steps"]] == [s["reward_mean"] for s in straight["steps"]]
    assert resumed["param_sha256"] == straight["param_sha256"]
    if example == "ppo_tiny":
        assert resumed["value_param_sha256"] == straight["value_param_sha256"]
    if example == "grpo_async_tiny":  # the buffer held groups at the checkpoint, and they were trained
        saved = json.loads((ckpt / f"step_{every:06d}" / "driver.json").read_text())["controller"]
        assert saved["slots"] and (ckpt / f"step_{every:06d}" / "buffer").is_dir()
        assert [s["staleness_max"] for s in resumed["steps"]] == [s["staleness_max"] for s in straight["steps"]]
    kept = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert kept[-1] == f"step_{steps:06d}" and len(kept) <= 2, kept


@pytest.mark.timeout(600)
def test_grpo_killed_after_a_checkpoint_resumes_to_the_same_bits(tmp_path: Path) -> None:
    check_resume(tmp_path, "grpo_tiny", steps=4, every=2)


@pytest.mark.timeout(600)
def test_async_grpo_killed_after_a_checkpoint_resumes_to_the_same_bits(tmp_path: Path) -> None:
    """The replay buffer's committed groups die with the driver's mooncake://local and come back from
    the checkpoint's snapshot; the resumed run trains exactly what the straight run trained."""
    check_resume(tmp_path, "grpo_async_tiny", steps=4, every=2)


@pytest.mark.soak
@pytest.mark.parametrize("example", ["grpo_tiny", "ppo_tiny", "grpo_async_tiny"])
def test_ten_steps_killed_and_ten_resumed_equal_twenty_straight(tmp_path: Path, example: str) -> None:
    check_resume(tmp_path, example, steps=20, every=10)


@pytest.mark.timeout(600)
def test_a_trainer_rank_killed_mid_run_is_replaced_and_the_run_ends_as_if_it_had_not(
    ray_cluster: None, tmp_path: Path
) -> None:
    """``--max-restarts 1``: rank 1 dies after step 3; step 4 fails, every actor is replaced, the run
    goes on from the checkpoint of step 2 and ends with the bits of a run nobody killed."""
    import io
    from dataclasses import replace

    import ray

    import dataplane
    from integrations.rl.examples import grpo_tiny

    opts = grpo_tiny.Options(steps=5, prompts_per_step=4, group_size=4, seed=4, progress=True)
    killed: list[Any] = []
    with dataplane.connect("mooncake://local") as owner:
        cluster = grpo_tiny.Cluster.start(opts)
        try:
            straight = grpo_tiny.run(opts, cluster=cluster, client=owner, out=io.StringIO())

            def on_step(record: Any, loop: Any) -> None:
                if record.step == 2 and not killed:
                    killed.append(cluster.policy.actors[1])
                    ray.kill(cluster.policy.actors[1], no_restart=True)

            out = io.StringIO()
            faulty = replace(opts, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, max_restarts=1)
            doc = grpo_tiny.run(faulty, cluster=cluster, client=owner, on_step=on_step, out=out)
            assert not any(owner.kv_list().values()), "nothing of the aborted step (or any other) is left"
        finally:
            cluster.shutdown()
    assert killed and [(r["failed_step"], r["resumed_after_step"]) for r in doc["restarts"]] == [(3, 2)]
    assert "step 4 failed (ActorFailure)" in out.getvalue() and "steps 3..4 are redone" in out.getvalue()
    assert [s["step"] for s in doc["steps"]] == list(range(5))
    assert [s["reward_mean"] for s in doc["steps"]] == [s["reward_mean"] for s in straight["steps"]]
    assert doc["param_sha256"] == straight["param_sha256"]
    with pytest.raises(dataplane.InvalidArgument, match="max-restarts"):
        grpo_tiny.Options(max_restarts=-1)
