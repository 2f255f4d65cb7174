"""Worker mixin over NCCL: the scenarios of ``tests/worker/test_worker.py`` on 2-4 GPUs, one process per GPU.

Replica groups of two ranks (``new_group`` on every rank), each rank with its own ``memory://`` store
filled deterministically with the same rows (no cross-process store yet). Timings: ``python -m
benchmarks.worker_gpu`` (reports in ``benchmarks/reports/``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_worker import (
    GROUP,
    SCENARIOS,
    check_failures,
    check_mesh,
    check_policies,
    check_timeout,
    check_writeback,
    run_group,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs (NCCL replica groups)"),
]


@pytest.fixture(scope="module")
def nccl_results() -> tuple[int, dict[int, dict[str, Any]]]:
    world = 4 if torch.cuda.device_count() >= 4 else 2
    return world, run_group(world, "nccl", list(SCENARIOS), timeout_s=300)


def test_every_policy_matches_an_independent_read_nccl(nccl_results: tuple[int, dict[int, dict[str, Any]]]) -> None:
    world, got = nccl_results
    check_policies(got, world)
    for rank, out in got.items():
        for case, r in out["policies"].items():
            # device=None leaves data where the transfer put it: CPU for independent reads, the GPU for NCCL
            want = "cpu" if case.endswith("/None") and "/independent/" in case else f"cuda:{rank}"
            assert r["device"] == want, (rank, case, r["device"])


def test_failing_leader_raises_on_every_rank_nccl(nccl_results: tuple[int, dict[int, dict[str, Any]]]) -> None:
    check_failures(nccl_results[1], limit_s=20.0)


def test_write_back_one_put_per_key_nccl(nccl_results: tuple[int, dict[int, dict[str, Any]]]) -> None:
    world, got = nccl_results
    check_writeback(got, total_rows=12)
    assert sum(out["writeback"]["puts"] for out in got.values()) == world // GROUP


def test_replica_groups_from_device_mesh_nccl(nccl_results: tuple[int, dict[int, dict[str, Any]]]) -> None:
    check_mesh(nccl_results[1], nccl_results[0])


def test_absent_leader_times_out_nccl(nccl_results: tuple[int, dict[int, dict[str, Any]]]) -> None:
    check_timeout(nccl_results[1])
