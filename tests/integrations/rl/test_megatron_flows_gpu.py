"""The Megatron worker in the RL flows, on GPUs: the trainer actors take it like any RL worker.

* the examples as a user runs them (a process each: its own Ray with the GPUs, ``mooncake://local``),
  ``--worker megatron --device cuda --dp 1``: GRPO learns in 20 steps (the CPU rule: the mean reward of
  the last 3 steps beats the first step's by 0.25) and its data-plane run ends with the inline run's
  ``param_sha256``; PPO learns with the value shift, beside its ``--no-value-shift`` ablation;
  asynchronous GRPO keeps its staleness window. The rollout's tiny model samples with the weights the
  Megatron policy exports (TP / PP shards gathered, renamed), so the sampler's log-probs equal the
  trainer's;
* on one Ray and one set of actors, a rebuild tears Megatron's ``parallel_state`` down and sets it up
  again (the same bits from the same seed), and the same actors then build FSDP2 workers;
* the exported weights, in the tiny model, compute what the Megatron model computes, at every layout
  the machine has GPUs for (one GPU; tp2, pp2 on two; dp2 x tp2 on four).

Needs CUDA GPUs, megatron-core (Python >= 3.12), Ray and Mooncake; CI has none of them and skips the
module. Each example run's output, JSON and step log go to ``$DATAPLANE_GPU_RECORD_DIR`` when set (a
dated record in ``docs/gpu-runs/`` is made from them), else to a temporary directory::

    DATAPLANE_GPU_RECORD_DIR=/tmp/record python -m pytest tests/integrations/rl/test_megatron_flows_gpu.py -v
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from rl_checks import check_trainer_times

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.mooncake,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL trainer ranks)"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="needs megatron-core (pip install 'dataplane[megatron]'; Python >= 3.12 and CUDA)",
    ),
    pytest.mark.filterwarnings("default"),  # a scarce GPU run checks the flows, not Ray's or Megatron's warnings
]

pytest.importorskip("ray", reason="needs Ray")
pytest.importorskip("mooncake.store", reason="needs Mooncake")

ROOT = Path(__file__).resolve().parents[3]
MEGATRON = ["--worker", "megatron", "--device", "cuda", "--dp", "1"]


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory: Any) -> Path:
    where = os.environ.get("DATAPLANE_GPU_RECORD_DIR")
    path = Path(where) if where else tmp_path_factory.mktemp("megatron_flows")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_example(example: str, argv: list[str], out: Path, tag: str) -> dict[str, Any]:
    """``python -m integrations.rl.examples.<example> argv``: its output in ``out/<tag>.txt``, its JSON in
    ``out/<tag>.json``, its step log in ``out/<tag>_steps.jsonl``; returns the JSON."""
    log_dir = out / f"{tag}_log"
    cmd = [sys.executable, "-m", f"integrations.rl.examples.{example}", *argv]
    proc = subprocess.run(
        [*cmd, "--json", str(out / f"{tag}.json"), "--log-dir", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    text = f"$ python -m integrations.rl.examples.{example} {' '.join(argv)}\n{proc.stdout}\n{proc.stderr[-20000:]}"
    (out / f"{tag}.txt").write_text(text)
    assert proc.returncode == 0, text[-6000:]
    if (log_dir / "steps.jsonl").exists():
        (log_dir / "steps.jsonl").replace(out / f"{tag}_steps.jsonl")
    return json.loads((out / f"{tag}.json").read_text())  # type: ignore[no-any-return]


def margin(doc: dict[str, Any]) -> float:
    """The mean reward of the last 3 steps minus the first step's (the CPU tests' rule wants > 0.25)."""
    rewards = [s["reward_mean"] for s in doc["steps"]]
    return float(sum(rewards[-3:]) / 3 - rewards[0])


def check_megatron_run(doc: dict[str, Any], *, data_plane: bool, models: tuple[str, ...]) -> None:
    """One GPU rank over NCCL holding Megatron workers (their parallel state set up by the actor once),
    the trainer's times per step, and (synchronous runs: the rows were sampled with the weights being
    trained) a sampler that computes what the trainer computes."""
    assert doc["device"] == "cuda" and doc["options"]["worker"] == "megatron"
    (rank,) = doc["trainers"]
    assert rank["backend"] == "nccl" and rank["device"].startswith("cuda"), rank
    assert rank["workers"] == dict.fromkeys(models, "TinyMegatronWorker"), rank
    assert rank["parallel_states"] == ["TinyMegatronWorker"] and rank["layout"] == {"dp": 1, "tp": 1, "pp": 1}
    check_trainer_times(doc, data_plane=data_plane)
    if data_plane:
        assert doc["bytes_get"] > 0 and doc["driver_bytes_get"] < 0.01 * doc["bytes_get"]
    else:
        assert doc["bytes_get"] == doc["bytes_put"] == 0
    for s in doc["steps"]:
        assert s["weight_sync_seconds"] > 0, s
        gap = s.get("sampler_logprob_diff_max")
        if doc["algorithm"] != "grpo_async":  # asynchronous rows come from weights up to K versions old
            assert gap is None or gap < 1e-3, s  # the rollout's tiny model got the Megatron policy's weights


def test_grpo_on_megatron_learns_and_its_data_plane_run_ends_with_the_inline_bits(record_dir: Path) -> None:
    argv = [*MEGATRON, "--steps", "20"]
    dp = run_example("grpo_tiny", [*argv, "--transport", "dataplane"], record_dir, "grpo_megatron_dataplane")
    inline = run_example("grpo_tiny", [*argv, "--transport", "inline"], record_dir, "grpo_megatron_inline")
    check_megatron_run(dp, data_plane=True, models=("policy", "reference"))
    check_megatron_run(inline, data_plane=False, models=("policy", "reference"))
    assert dp["param_sha256"] == inline["param_sha256"]
    assert [s["reward_mean"] for s in dp["steps"]] == [s["reward_mean"] for s in inline["steps"]]
    assert [s["loss"] for s in dp["steps"]] == [s["loss"] for s in inline["steps"]]
    assert margin(dp) > 0.25, [s["reward_mean"] for s in dp["steps"]]


def test_ppo_on_megatron_learns_with_the_value_shift_beside_the_ablation(record_dir: Path) -> None:
    argv = [*MEGATRON, "--steps", "20"]
    shifted = run_example("ppo_tiny", argv, record_dir, "ppo_megatron")
    ablation = run_example("ppo_tiny", [*argv, "--no-value-shift"], record_dir, "ppo_megatron_no_value_shift")
    for doc in (shifted, ablation):
        check_megatron_run(doc, data_plane=True, models=("policy", "value"))
        assert doc["value_param_sha256"] != doc["param_sha256"]
    assert shifted["options"]["value_shift"] and not ablation["options"]["value_shift"]
    assert margin(shifted) > 0.25, [s["reward_mean"] for s in shifted["steps"]]
    print(f"PPO on Megatron: value shift {margin(shifted):+.3f}, without it {margin(ablation):+.3f}")


def test_async_grpo_on_megatron_keeps_its_staleness_window(record_dir: Path) -> None:
    doc = run_example(
        "grpo_async_tiny", [*MEGATRON, "--steps", "8", "--max-staleness", "1"], record_dir, "grpo_async_megatron"
    )
    check_megatron_run(doc, data_plane=True, models=("policy", "reference"))
    assert doc["max_trained_staleness"] <= 1 and len(doc["steps"]) == 8


def test_a_rebuild_tears_megatrons_parallel_state_down_and_the_actors_take_another_worker() -> None:
    import ray

    from integrations.rl.examples import grpo_tiny
    from integrations.rl.examples.common import start_ray
    from integrations.rl.workers.model import TinyConfig
    from integrations.rl.workers.tiny import TinyDTensorWorker

    opts = replace(grpo_tiny.DEFAULTS, worker="megatron", device="cuda", dp=1, steps=2, seed=5, transport="inline")
    opts = replace(opts, progress=False)
    started = start_ray(opts)
    cluster = grpo_tiny.Cluster.start(opts)
    try:
        first = grpo_tiny.run(opts, cluster=cluster)  # a reset: the actor rebuilds (teardown, set-up, build)
        second = grpo_tiny.run(opts, cluster=cluster)
        assert first["param_sha256"] == second["param_sha256"]  # rebuilt from the seed, on a fresh state
        assert cluster.policy.describe()[0]["parallel_states"] == ["TinyMegatronWorker"]
        # the same actors, another stack: Megatron's state is torn down, FSDP2 builds its own mesh
        cluster.policy.build({"policy": functools.partial(TinyDTensorWorker, TinyConfig(), device="cuda")})
        (rank,) = cluster.policy.describe()
        assert rank["workers"] == {"policy": "TinyDTensorWorker"} and rank["parallel_states"] == []
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()


LAYOUTS = {"one_gpu": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2), "dp2xtp2": (4, 2, 1)}  # world, tp, pp


def _export(rank: int, world: int, tp: int, pp: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from tensordict import TensorDict

    from dataplane import KVBatchMeta
    from integrations.rl.trainer_actor import param_digest
    from integrations.rl.workers.layout import RankLayout
    from integrations.rl.workers.megatron_tiny import TinyMegatronWorker
    from integrations.rl.workers.model import TinyCausalLM, TinyConfig

    layout = RankLayout.for_world(world, tp=tp, pp=pp)
    TinyMegatronWorker.setup_parallel_state(layout)  # what the trainer actor runs before the factories
    cfg = TinyConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, max_len=32)
    worker = TinyMegatronWorker(cfg, tp=tp, pp=pp, seed=3, init="tiny")  # the FSDP2 worker's weights
    exported = worker.export_weights()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        start = TinyCausalLM(cfg)
    same_start = all(torch.equal(exported[n], p.detach()) for n, p in start.named_parameters())
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 16, (4, 12), generator=g)
    meta = KVBatchMeta(partition_id="p", keys=tuple(f"k{i}" for i in range(4)), sequence_lengths=(12,) * 4)
    data = TensorDict({"input_ids": ids.cuda()}, batch_size=[4])
    megatron_lp = worker.forward_logprobs(data, meta)  # every stage gets the last stage's result
    tiny = TinyCausalLM(cfg)
    tiny.load_state_dict(exported)
    with torch.no_grad():
        tiny_lp = tiny(ids, output="logprobs")
    out = {
        "rank": rank,
        "place": (
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        ),
        "want": (layout.tp_rank(rank), layout.dp_rank(rank), layout.pp_rank(rank)),
        "names": list(exported) == [n for n, _ in tiny.named_parameters()],
        "same_start": same_start,
        "digest": param_digest(exported).sha256,
        "max_diff": float((megatron_lp - tiny_lp).abs().max()),
    }
    TinyMegatronWorker.teardown_parallel_state()
    out["torn_down"] = not ps.model_parallel_is_initialized()
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_exported_weights_compute_the_tiny_models_function(layout: str) -> None:
    from dataplane.testing.ranks import run_ranks

    world, tp, pp = LAYOUTS[layout]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    results = run_ranks(_export, world, tp, pp, backend="nccl", timeout_s=300, pg_timeout_s=120)
    for r in results:
        assert r["place"] == r["want"] and r["names"] and r["same_start"] and r["torn_down"], r
        assert r["max_diff"] < 1e-5, r
    assert len({r["digest"] for r in results}) == 1  # every rank exports the same whole weights
