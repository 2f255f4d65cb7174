"""``integrations.verl.install`` in a driver process of its own (it changes ``sys.path``, the
environment and the meaning of ``import transfer_queue``, so never in the test process): a process
started afterwards sees the facade and the deployment through its environment alone; a checkpoint
outlives the deployment it was taken from; once the real TransferQueue is imported, install refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
JOB = Path(__file__).with_name("facade_job.py")

pytestmark = [pytest.mark.multiprocess]

# the backend markers skip a case whose backend is not installed (tests/conftest.py)
MOONCAKE = pytest.param("mooncake://local?segment_bytes=64MiB", marks=pytest.mark.mooncake, id="mooncake")
# ~60 s (two TransferQueue deployments, one after the other): a soak variant; CI runs the Mooncake one,
# and test_verl_on_facade.py runs verl's own calls on tq:// in CI
TQ = pytest.param("tq://?backend=simple", marks=[pytest.mark.tq, pytest.mark.slow, pytest.mark.soak], id="tq-simple")


def _job(*args: str, timeout: int = 300) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAPLANE_VERL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in [os.environ.get("PYTHONPATH")] if p]])
    done = subprocess.run(
        [sys.executable, str(JOB), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("url", [MOONCAKE, TQ])
def test_processes_started_after_install_use_the_facade_and_checkpoints_outlive_the_store(
    url: str, tmp_path: Path
) -> None:
    out = _job(url, "serve", str(tmp_path))
    assert out["facade"] and out["env"] == [
        "DATAPLANE_VERL_PICKLE_FIELDS",
        "DATAPLANE_VERL_STRICT",
        "DATAPLANE_VERL_URL",
        "PYTHONPATH",
    ]
    assert "other processes" in out["memory"]  # memory:// refused first, leaving nothing behind
    child = out["child"]
    assert child["facade"] and child["fields"] == ["responses", "rm_scores", "uid"]  # "missing" dropped
    assert child["uid"] == ["p0", "p1"] and child["responses"] == list(range(10))
    assert child["put_fields"] == ["old_log_probs", "responses", "rm_scores", "uid"]
    assert child["put_tags"] == [{"seq_len": 5}, {"seq_len": 5}]  # the stored tags, merged
    assert out["written_back"] == [-5.0, -6.0, -7.0, -8.0, -9.0, -0.0, -1.0, -2.0, -3.0, -4.0]
    listing = {"p0": {"is_prompt": True, "status": "pending"}, "p1": {"is_prompt": True, "status": "pending"}}
    listing |= {"p0_0": {"seq_len": 5}, "p1_0": {"seq_len": 5}}
    assert out["listing"] == {"train": listing} and list(out["listing"]["train"]) == list(listing)
    assert out["new_deployment"] and out["empty_after_restart"]
    assert out["loaded_metadata"] == {"global_steps": 3}
    assert out["listing_after_load"] == out["listing"] and out["restored_equal"]
    # after uninstall(), the real TransferQueue imported first makes install() refuse
    assert out["refused"] and "before importing verl or transfer_queue" in out["refused"]
