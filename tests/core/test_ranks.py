"""``dataplane.testing.ranks.run_ranks``: results in rank order (tensors by value), a raising rank's
traceback in a typed error, and a hung rank killed at the deadline."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dataplane.testing.ranks import RankFailure, run_ranks

pytestmark = pytest.mark.multiprocess


def _sum_and_tensor(rank: int, world: int, base: int) -> tuple[int, torch.Tensor, int]:
    t = torch.tensor([float(rank + base)])
    dist.all_reduce(t)
    return rank, torch.full((3,), float(rank)), int(t.item())


def _raise_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _hang_on_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(60)
    return rank


def test_results_come_back_in_rank_order_with_tensors_by_value() -> None:
    got = run_ranks(_sum_and_tensor, 3, 10, timeout_s=60)
    assert [r for r, _, _ in got] == [0, 1, 2]
    assert all(torch.equal(t, torch.full((3,), float(r))) for r, t, _ in got)
    assert {s for _, _, s in got} == {10 + 11 + 12}, "one all_reduce over a real gloo group"


def test_a_raising_rank_gives_a_typed_error_with_its_traceback() -> None:
    with pytest.raises(RankFailure, match="rank one says no") as info:
        run_ranks(_raise_on_one, 2, timeout_s=60)
    assert "rank 1:" in str(info.value) and "ValueError" in str(info.value)


def test_a_hung_rank_is_killed_at_the_deadline() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[1\] reported nothing within 3 s"):
        run_ranks(_hang_on_one, 2, timeout_s=3)
    assert time.monotonic() - t0 < 30
