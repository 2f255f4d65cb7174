"""Four gloo ranks run their planned microbatches in lockstep, one all_reduce each, and all finish.

The same length sets packed naively (each rank packs its own rows greedily under the budget) give
ranks different microbatch counts: that run would hang in the first collective the short rank never
reaches. The naive counts are computed, never run.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataplane.meta import KVBatchMeta
from dataplane.preshard import plan_shards, shard_meta_for_dp

pytestmark = pytest.mark.multiprocess

WORLD = 4
SETS = 20
BUDGET = 4096
DEADLINE_S = 90.0


def length_sets() -> list[list[int]]:
    rng = np.random.default_rng(2024)
    out = []
    for s in range(SETS):
        n = int(rng.integers(WORLD, 160))
        if s % 4 == 3:  # adversarial: a few rows near the budget among many short ones
            x = np.where(rng.random(n) < 0.1, rng.integers(3000, 6000, n), rng.integers(1, 80, n))
        else:
            x = np.clip(rng.lognormal(6.0, 1.1, n), 1, 8192)
        out.append([int(v) for v in x])
    return out


def greedy_count(lengths: list[int]) -> int:
    """Microbatches one rank makes packing its own rows in order, starting a new one when full."""
    count, tokens = 0, None
    for x in lengths:
        if tokens is None or tokens + x > BUDGET:
            count, tokens = count + 1, x
        else:
            tokens += x
    return count


def naive_counts(lengths: list[int], balanced: bool) -> list[int]:
    """Per-rank counts of local packing: of contiguous chunks (the old way), or of token-balanced
    rows that were split without a shared plan."""
    if balanced:
        groups = [sorted(r) for r in plan_shards(lengths, WORLD).rows]
    else:
        meta = KVBatchMeta(partition_id="p", keys=[f"k{i}" for i in range(len(lengths))])
        groups = [[int(k[1:]) for k in shard.keys] for shard in meta.chunk(WORLD)]
    return [greedy_count([lengths[i] for i in g]) for g in groups]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, shard_bytes: list[list[bytes]], out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    try:
        report = []
        for per_rank in shard_bytes:
            shard = KVBatchMeta.from_msgpack(per_rank[rank])  # what a worker receives from the driver
            lens = shard.sequence_lengths or ()
            steps, total = 0, 0
            for mb in shard.extra_info["microbatches"]:
                t = torch.tensor([sum(lens[i] for i in mb), len(mb)], dtype=torch.int64)
                dist.all_reduce(t)  # one cross-DP collective per microbatch, like a gradient sync
                steps += 1
                total += int(t[0])
            report.append({"steps": steps, "tokens": total})
        dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_planned_microbatches_run_in_lockstep(tmp_path: Path) -> None:
    sets = length_sets()
    shard_bytes = []
    for s, lengths in enumerate(sets):
        meta = KVBatchMeta(
            partition_id="train", keys=[f"s{s}_r{i}" for i in range(len(lengths))], sequence_lengths=lengths
        )
        shard_bytes.append([m.to_msgpack() for m in shard_meta_for_dp(meta, WORLD, max_tokens_per_microbatch=BUDGET)])

    for balanced in (False, True):
        naive = [naive_counts(lengths, balanced) for lengths in sets]
        assert any(len(set(c)) > 1 for c in naive), f"local packing (balanced={balanced}) should differ across ranks"

    ctx = mp.start_processes(
        _rank_main, args=(_free_port(), shard_bytes, str(tmp_path)), nprocs=WORLD, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks did not finish within {DEADLINE_S} s: a collective is stuck")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for s, lengths in enumerate(sets):
        steps = {reports[r][s]["steps"] for r in range(WORLD)}
        assert len(steps) == 1, f"set {s}: ranks ran {steps} microbatches"
        assert all(reports[r][s]["tokens"] == sum(lengths) for r in range(WORLD)), "every row ran exactly once"
