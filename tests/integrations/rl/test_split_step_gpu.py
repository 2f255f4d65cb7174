"""The split-step parity of ``test_split_step.py`` on GPUs over NCCL: FSDP2 with 2 ranks, and
dp2 x tp2 where 4 GPUs exist. Run on the lent GPU machine; CI has no GPU and skips it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_split_step import CASES, count, equivalence, is_pow2

from dataplane.testing.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs (NCCL process groups)"),
]

CASES_RUN = [(c, t, "sgd") for c in CASES for t in ("token", "sequence")] + [("dummy_pow2", "token", "adamw")]


def _main(rank: int, world: int, tp: int) -> dict[str, Any]:
    return equivalence(rank, world, tp, CASES_RUN if tp == 1 else CASES_RUN[2:4], device="cuda")


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_split_step_equals_the_one_shot_step_nccl(world: int, tp: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = run_ranks(_main, world, tp, backend="nccl", timeout_s=300)
    for key, r in results[0].items():
        case, loss_type, opt = key.split("/")
        assert r["num_elements"] == count(case, loss_type) and r["changed"] and r["version"] == 1, (key, r)
        if is_pow2(r["n"]):
            assert r["microbatched"]["bitwise"], (key, r)
        if opt == "sgd":
            assert r["microbatched"]["max_rel"] < 1e-5 and r["whole"]["max_rel"] < 1e-5, (key, r)
    assert all(r == results[0] for r in results[1:]), "every rank gathers the same parameters"
