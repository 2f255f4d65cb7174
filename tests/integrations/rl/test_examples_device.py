"""The examples' ``--device`` flag and the trainer ranks' data/compute clock, without Ray or a GPU.

``--device cpu`` (the default) must leave the run as it was: no device argument to the workers, no
GPU or NCCL option to the trainer actors, no GPU to Ray. ``--device cuda`` with fewer CUDA devices
than trainer ranks is refused up front with a typed error that says what to change. The GPU run
itself is ``test_examples_gpu.py``.
"""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch

from dataplane import InvalidArgument
from integrations.rl.examples import cli, grpo_async_tiny, grpo_tiny, ppo_tiny
from integrations.rl.metering import add_totals
from integrations.rl.sync_loop import StepRecord
from integrations.rl.trainer_actor import StepClock, TrainerActor

EXAMPLES = [grpo_tiny, ppo_tiny, grpo_async_tiny]


def parse(example: Any, *argv: str) -> grpo_tiny.Options:
    return cli.parse_args(list(argv), defaults=example.DEFAULTS, module=example.__name__, doc="doc")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_device_defaults_to_cpu_and_adds_nothing_there(example: Any) -> None:
    opts = parse(example)
    assert opts.device == "cpu" == example.DEFAULTS.device
    assert opts.trainer_resources() == {} and opts.ray_resources() == {}  # Policy.spawn and ray.init as before
    for name, factory in opts.factories().items():
        assert "device" not in factory.keywords, name  # TinyDTensorWorker's own default: "cpu"
    assert parse(example, "--device", "cpu") == opts


def test_device_cuda_needs_a_gpu_per_trainer_rank(monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(InvalidArgument, match=r"dp x tp x pp = 2 x 1 x 1 = 2 trainer ranks.*sees 0 CUDA.*--device cpu"):
        parse(grpo_tiny, "--device", "cuda")
    # the command line says so and exits 2 before starting anything
    assert grpo_tiny.main(["--device", "cuda", "--steps", "1"]) == 2
    assert "error: --device cuda puts each of the dp x tp" in capsys.readouterr().err

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(InvalidArgument, match=r"2 x 2 x 1 = 4 trainer ranks.*sees 3 CUDA.*dp x tp x pp <= 3"):
        parse(grpo_tiny, "--device", "cuda", "--tp", "2")
    with pytest.raises(InvalidArgument, match="'cpu' or 'cuda'"):
        grpo_tiny.Options(device="gpu")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parse(grpo_tiny, "--device", "tpu")

    opts = parse(ppo_tiny, "--device", "cuda")  # 2 ranks on 3 GPUs
    assert opts.device == "cuda"
    assert opts.trainer_resources() == {"num_gpus": 1, "backend": "nccl", "deterministic": True}
    assert opts.ray_resources() == {"num_gpus": 3}
    factories = opts.factories()
    assert set(factories) == {"policy", "value"}
    assert all(f.keywords["device"] == "cuda" for f in factories.values())


def test_step_clock_splits_data_from_compute() -> None:
    class Worker:  # the shape of a DTensorRLWorkerMixin's calls: an inner fetch and write-back
        def fetch_agreed(self, meta: Any, fields: Any) -> str:
            time.sleep(0.03)
            return "data"

        def write_back(self, meta: Any, fields: Any) -> None:
            time.sleep(0.01)

        def get_logprobs_presharded(self, meta: Any) -> None:
            self.fetch_agreed(meta, ["input_ids"])  # through the instance: the wrapped method
            time.sleep(0.05)  # the forward
            self.write_back(meta, {})

    clock = StepClock()
    worker = Worker()
    TrainerActor._time_data_movement(types.SimpleNamespace(clock=clock), worker)  # type: ignore[arg-type]
    worker.fetch_agreed(None, [])  # outside a step call: not counted
    assert clock.totals() == {"trainer_data_seconds": 0.0, "trainer_compute_seconds": 0.0}

    with clock.call(), clock.call():  # nested calls (train -> begin, train_chunk, finish) count once
        worker.get_logprobs_presharded(None)
    totals = clock.totals()
    assert 0.04 <= totals["trainer_data_seconds"] < 0.5
    assert 0.05 <= totals["trainer_compute_seconds"] < 0.5

    with pytest.raises(RuntimeError), clock.call():  # a failed call adds nothing
        worker.fetch_agreed(None, [])
        raise RuntimeError("boom")
    assert clock.totals() == totals


def test_step_record_keeps_trainer_times_per_rank() -> None:
    trainers = [{"seconds": 0.5, "trainer_data_seconds": 0.2, "trainer_compute_seconds": 1.0}] * 2
    driver = {"bytes_put": 8, "seconds": 0.1, "calls": 1}
    traffic = add_totals(driver, *trainers)
    assert traffic["trainer_data_seconds"] == pytest.approx(0.4) and traffic["seconds"] == pytest.approx(1.1)
    record = StepRecord(step=0, partition_id="p", reward_mean=0.5)
    record.set_traffic(traffic, ranks=2)
    summary = record.summary()
    assert summary["trainer_data_seconds"] == pytest.approx(0.2)
    assert summary["trainer_compute_seconds"] == pytest.approx(1.0)
    assert summary["data_plane_seconds"] == pytest.approx(1.1)
