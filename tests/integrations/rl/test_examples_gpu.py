"""The GRPO example with its trainer ranks on 2 GPUs over NCCL (``--device cuda``): the checks of
``test_rl_loops.py`` on GPUs. Run on the lent GPU machine; CI has no GPU and skips it.

* the command as a user runs it (a fresh process: its own Ray with the GPUs, ``mooncake://local``):
  each rank on a GPU of its own, NCCL, and per step the ranks' data-plane seconds beside their
  compute seconds;
* on one Ray and one set of actors (``Cluster.reset`` between runs, as in ``test_rl_loops.py``): a
  run through ``mooncake://local`` ends with the ``param_sha256``, rewards and losses of the run
  with the tensors through the driver (``--transport inline``), and split and monolithic steps agree.

Ray's workers import ``integrations`` the way this process does: with the checkout on
``PYTHONPATH`` where it is not installed.

    python -m pytest tests/integrations/rl/test_examples_gpu.py -v
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from rl_checks import check_trainer_times

import dataplane
from integrations.rl.examples import grpo_tiny
from integrations.rl.examples.common import start_ray

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.mooncake,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs (2 NCCL trainer ranks)"),
    # warnings stay warnings here (not errors, as elsewhere): a GPU run is scarce, and a new warning of
    # Ray or CUDA at start-up is not what it checks
    pytest.mark.filterwarnings("default"),
]

pytest.importorskip("ray", reason="needs Ray")
pytest.importorskip("mooncake.store", reason="needs Mooncake")

ROOT = Path(__file__).resolve().parents[3]
BACKEND = "mooncake://local"


def options(**changes: Any) -> grpo_tiny.Options:
    """The example's settings on 2 GPUs, 3 steps (built in the tests: ``device="cuda"`` checks the GPUs)."""
    return replace(grpo_tiny.DEFAULTS, device="cuda", dp=2, steps=3, seed=3, progress=False, **changes)


def check_gpu_run(doc: dict[str, Any], *, data_plane: bool) -> None:
    """Each rank on a GPU of its own over NCCL; per step, the ranks' data and compute seconds (data-plane
    runs spend some in reads and write-backs), summed in the run's figures."""
    assert doc["device"] == "cuda" and doc["options"]["device"] == "cuda"
    trainers = doc["trainers"]
    assert [t["backend"] for t in trainers] == ["nccl", "nccl"], trainers
    assert all(t["device"].startswith("cuda") for t in trainers), trainers
    assert len({t["gpu_uuid"] or t["cuda_visible_devices"] for t in trainers}) == 2, trainers  # two GPUs
    check_trainer_times(doc, data_plane=data_plane)
    if data_plane:
        assert doc["bytes_get"] > 0
        assert doc["driver_bytes_get"] < 0.01 * doc["bytes_get"]
    else:
        assert doc["bytes_get"] == doc["bytes_put"] == 0


def test_the_example_command_runs_on_two_gpus(tmp_path: Path) -> None:
    """First in the module: its process starts a Ray of its own before this one starts the module's."""
    out = tmp_path / "run.json"
    argv = ["--device", "cuda", "--dp", "2", "--steps", "2", "--backend", BACKEND, "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "integrations.rl.examples.grpo_tiny", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == BACKEND and doc["transport"] == "dataplane" and len(doc["steps"]) == 2
    check_gpu_run(doc, data_plane=True)
    lines = proc.stdout.splitlines()
    assert sum("per trainer: data" in line for line in lines) == 2  # a line per step
    assert "(2 GPU trainer ranks): data" in lines[-2], lines[-3:]  # the summary, then "wrote ..."


@pytest.fixture(scope="module")
def ray_gpus() -> Iterator[None]:
    import ray

    started = start_ray(options())  # what the example does: every GPU torch sees
    if ray.cluster_resources().get("GPU", 0) < 2:  # type: ignore[no-untyped-call]
        pytest.skip("this process runs a Ray without 2 GPUs; run this file on its own")
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def owner(ray_gpus: None) -> Iterator[dataplane.DataPlaneClient]:
    with dataplane.connect(BACKEND) as client:
        yield client


@pytest.fixture(scope="module")
def cluster(owner: Any) -> Iterator[grpo_tiny.Cluster]:  # stopped before the store its actors use
    c = grpo_tiny.Cluster.start(options())
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def inline_run(cluster: grpo_tiny.Cluster) -> dict[str, Any]:
    return grpo_tiny.run(options(transport="inline"), cluster=cluster)


@pytest.fixture(scope="module")
def split_run(cluster: grpo_tiny.Cluster, owner: Any) -> dict[str, Any]:
    return grpo_tiny.run(options(), cluster=cluster, client=owner)


def test_dataplane_run_equals_the_inline_run_bit_for_bit_on_gpus(
    split_run: dict[str, Any], inline_run: dict[str, Any]
) -> None:
    check_gpu_run(split_run, data_plane=True)
    check_gpu_run(inline_run, data_plane=False)
    assert split_run["steps"][-1]["version"] >= 1  # something trained
    # parity: the same algorithm, plan and seeds without the data plane ends with the same bits
    assert split_run["param_sha256"] == inline_run["param_sha256"]
    assert [s["reward_mean"] for s in split_run["steps"]] == [s["reward_mean"] for s in inline_run["steps"]]
    assert [s["loss"] for s in split_run["steps"]] == [s["loss"] for s in inline_run["steps"]]


def test_split_and_monolithic_steps_agree_on_gpus(
    cluster: grpo_tiny.Cluster, owner: Any, split_run: dict[str, Any]
) -> None:
    mono = grpo_tiny.run(options(train_step="monolithic"), cluster=cluster, client=owner)
    check_gpu_run(mono, data_plane=True)
    assert split_run["train_step"] == "split" and mono["train_step"] == "monolithic"
    assert [s["version"] for s in split_run["steps"]] == [s["version"] for s in mono["steps"]]
    assert split_run["steps"][-1]["version"] >= 1
    # chunks are sharded on their own: other row placements, other summation order -> rounding only
    # (1e-6 on the CPU; GPU kernels may sum in other orders again)
    assert split_run["param_norm"] == pytest.approx(mono["param_norm"], rel=1e-5)
