"""What the data plane saves in one RL step, against the driver funnel (WIP, issue 39).

    python -m benchmarks.rl_step --quick
    python -m benchmarks.rl_step --sizes 64,512 --json rl_step.json

Replays the data movement of one GRPO step without model compute, on one rollout process and four
trainer ranks (dp=2 x tp=2: the TP siblings of a DP rank get their shard by leader broadcast):

1. ``rollout_write``: the rollout process writes the batch (``input_ids`` int64, ``loss_mask`` bool,
   ``gen_logprobs`` and ``ref_logprobs`` fp32 per token, ``reward`` fp32 per row);
2. ``advantages``: the driver reads ``reward`` and writes per-row ``advantages``;
3. ``logprobs``: each DP leader fetches its shard's ``input_ids`` and ``loss_mask`` (broadcast to
   its TP sibling) and writes back ``prev_logprobs`` per token;
4. ``train``: each DP leader fetches five fields (broadcast to its sibling);
5. ``clear``.

Contenders: every installed multi-process backend, and the **driver funnel** (what trainers without a
data plane do): the batch is gathered on the driver (``ray.get``), each DP shard scattered as a Ray
object ref, per-token results gathered back to the driver.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

import dataplane
from dataplane import KVBatchMeta
from dataplane.columns import first_write
from dataplane.preshard import shard_meta_for_dp
from dataplane.worker.mixin import DataPlaneWorkerMixin

from benchmarks.workload import rollout_lengths

DP, TP = 2, 2
TOKEN_FIELDS = ("input_ids", "loss_mask", "gen_logprobs", "ref_logprobs")
TRAIN_FIELDS = ("input_ids", "loss_mask", "prev_logprobs", "ref_logprobs", "advantages")
BYTES_PER_TOKEN = 8 + 1 + 4 + 4


MEAN_LEN, MAX_LEN = 1024, 8192


def batch_rows(size_bytes: int, group_size: int) -> int:
    """Rows of a batch of about ``size_bytes`` with responses ``MEAN_LEN`` tokens long on average."""
    unit = group_size * DP
    return max(unit, size_bytes // (BYTES_PER_TOKEN * MEAN_LEN) // unit * unit)


def make_rollout(size_bytes: int, rows: int, seed: int = 0) -> tuple[TensorDict, list[int]]:
    """About ``size_bytes`` of rollout rows, right-padded (zeros past each row), and their lengths."""
    rng = np.random.default_rng(seed)
    tokens = max(rows, size_bytes // BYTES_PER_TOKEN)
    lengths = rollout_lengths(rows, tokens / rows, rng, max_len=MAX_LEN)
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 150_000, (rows, width), generator=g) * mask
    data = TensorDict(
        {
            "input_ids": ids,
            "loss_mask": mask,
            "gen_logprobs": -torch.rand(rows, width, generator=g) * mask,
            "ref_logprobs": -torch.rand(rows, width, generator=g) * mask,
            "reward": torch.rand(rows, generator=g),
        },
        batch_size=[rows],
    )
    return data, [int(n) for n in lengths]


class RolloutProc:
    """The rollout process: builds its batch once, then writes it (or hands it over) per step."""

    def __init__(self, size_bytes: int, rows: int, group_size: int) -> None:
        torch.set_num_threads(1)
        self.data, self.lengths = make_rollout(size_bytes, rows)
        self.group_size = group_size
        self.client: Any = None

    def connect(self, url: str | None) -> None:
        if self.client is not None:
            self.client.close()
        self.client = None if url is None else dataplane.connect(url)

    def write(self, partition: str) -> KVBatchMeta:
        uids = [f"u{i}" for i in range(self.data.batch_size[0] // self.group_size)]
        return first_write(
            self.client,
            self.data,
            uids=uids,
            group_size=self.group_size,
            partition_id=partition,
            token_fields=TOKEN_FIELDS,
            lengths=self.lengths,
        )

    def batch(self) -> tuple[TensorDict, list[int]]:
        return self.data, self.lengths


class Rank(DataPlaneWorkerMixin):
    """One trainer rank of a dp x tp gloo group; TP siblings share a replica group."""

    def __init__(self, rank: int) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self._group: Any = None

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def join(self, port: int) -> None:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=DP * TP,
            timeout=timedelta(seconds=300),
        )
        for d in range(DP):  # every rank creates every group, in the same order
            g = dist.new_group([d * TP + t for t in range(TP)])
            if self.rank // TP == d:
                self._group = g

    def replica_group(self) -> Any:
        return self._group

    def connect(self, url: str | None) -> None:
        self.close_data_plane()
        if url is not None:
            self.setup_data_plane(url)

    # -- through the data plane --------------------------------------------------------------------
    def logprobs(self, shard: KVBatchMeta) -> int:
        got = self.fetch(shard, select_fields=["input_ids", "loss_mask"], policy="leader_broadcast")
        prev = got["loss_mask"].float() * -0.5  # stands in for the forward
        self.write_back(shard, {"prev_logprobs": prev}, token_fields=["prev_logprobs"])
        return int(prev.numel())

    def train(self, shard: KVBatchMeta) -> int:
        got = self.fetch(shard, select_fields=list(TRAIN_FIELDS), policy="leader_broadcast")
        return sum(int(v.numel() * v.element_size()) for v in got.values())

    # -- through the driver ------------------------------------------------------------------------
    def logprobs_inline(self, data: TensorDict) -> torch.Tensor | None:
        prev = data["loss_mask"].float() * -0.5
        return prev if self.rank % TP == 0 else None  # the leader's comes back

    def train_inline(self, data: TensorDict) -> int:
        return sum(int(v.numel() * v.element_size()) for v in data.values())


class _RssPeak:
    """The driver's peak resident memory above its start, sampled every 2 ms."""

    def __init__(self) -> None:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __enter__(self) -> _RssPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _group_advantages(reward: torch.Tensor, group_size: int) -> torch.Tensor:
    r = reward.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)


def _shards(meta: KVBatchMeta) -> list[KVBatchMeta]:
    return shard_meta_for_dp(meta, DP)


def step_dataplane(client: Any, rollout: Any, ranks: list[Any], group_size: int, step: int) -> dict[str, float]:
    import ray

    t: dict[str, float] = {}
    partition = f"rl-step-{step}"
    t0 = time.perf_counter()
    meta = ray.get(rollout.write.remote(partition))
    t["rollout_write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    reward = client.kv_batch_get(meta, select_fields="reward")["reward"]
    adv = _group_advantages(reward, group_size)
    client.kv_batch_put(list(meta.keys), {"advantages": adv}, partition_id=partition)
    meta = meta.with_fields(["advantages"])
    t["advantages"] = time.perf_counter() - t0
    shards = _shards(meta)
    t0 = time.perf_counter()
    ray.get([r.logprobs.remote(shards[i // TP]) for i, r in enumerate(ranks)])
    t["logprobs"] = time.perf_counter() - t0
    shards = [s.with_fields(["prev_logprobs"]) for s in shards]
    t0 = time.perf_counter()
    ray.get([r.train.remote(shards[i // TP]) for i, r in enumerate(ranks)])
    t["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.kv_clear(partition_id=partition)
    t["clear"] = time.perf_counter() - t0
    return t


def step_funnel(rollout: Any, ranks: list[Any], group_size: int) -> tuple[dict[str, float], int]:
    """The same phases with the batch through the driver; returns the times and the driver's bytes."""
    import ray

    t: dict[str, float] = {}
    moved = 0
    t0 = time.perf_counter()
    data, lengths = ray.get(rollout.batch.remote())
    moved += sum(int(v.numel() * v.element_size()) for v in data.values())
    t["rollout_write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    data["advantages"] = _group_advantages(data["reward"], group_size)
    t["advantages"] = time.perf_counter() - t0
    meta = KVBatchMeta(partition_id="funnel", keys=[f"k{i}" for i in range(len(lengths))], sequence_lengths=lengths)
    shards = _shards(meta)
    rows = [torch.tensor([meta.keys.index(k) for k in s.keys]) for s in shards]  # noqa: F841 (WIP)
    t0 = time.perf_counter()
    index = {k: i for i, k in enumerate(meta.keys)}
    parts = []
    for s in shards:
        idx = torch.tensor([index[k] for k in s.keys], dtype=torch.int64)
        width = max((lengths[i] for i in idx.tolist()), default=1)
        part = TensorDict({f: data[f][idx, :width] for f in ("input_ids", "loss_mask")}, batch_size=[len(idx)])
        moved += sum(int(v.numel() * v.element_size()) for v in part.values())
        parts.append(ray.put(part))
    outs = ray.get([r.logprobs_inline.remote(parts[i // TP]) for i, r in enumerate(ranks)])
    prev = torch.zeros(data["input_ids"].shape, dtype=torch.float32)
    for d, s in enumerate(shards):
        out = outs[d * TP]
        moved += int(out.numel() * out.element_size())
        idx = torch.tensor([index[k] for k in s.keys], dtype=torch.int64)
        prev[idx, : out.shape[1]] = out
    data["prev_logprobs"] = prev
    t["logprobs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    parts = []
    for s in shards:
        idx = torch.tensor([index[k] for k in s.keys], dtype=torch.int64)
        width = max((lengths[i] for i in idx.tolist()), default=1)
        fields = {f: (data[f][idx, :width] if data[f].dim() > 1 else data[f][idx]) for f in TRAIN_FIELDS}
        part = TensorDict(fields, batch_size=[len(idx)])
        moved += sum(int(v.numel() * v.element_size()) for v in part.values())
        parts.append(ray.put(part))
    ray.get([r.train_inline.remote(parts[i // TP]) for i, r in enumerate(ranks)])
    t["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    del data, parts, prev
    t["clear"] = time.perf_counter() - t0
    return t, moved


def measure(url: str | None, size_mb: int, repeat: int, warmup: int) -> dict[str, Any]:
    import ray

    group_size = 8
    rows = batch_rows(size_mb << 20, group_size)
    size = size_mb << 20
    rollout = ray.remote(RolloutProc).options(num_cpus=0.2).remote(size, rows, group_size)
    ranks = [ray.remote(Rank).options(num_cpus=0.2).remote(r) for r in range(DP * TP)]
    port = ray.get(ranks[0].free_port.remote())
    ray.get([r.join.remote(port) for r in ranks])
    ray.get([rollout.connect.remote(url)] + [r.connect.remote(url) for r in ranks])
    client = None if url is None else dataplane.connect(url)
    from integrations.rl.metering import TrafficMeter

    meter = TrafficMeter()
    if client is not None:
        client = meter.wrap(client)
    steps: list[dict[str, float]] = []
    peaks: list[int] = []
    driver_bytes: list[int] = []
    try:
        for i in range(warmup + repeat):
            before = meter.totals()
            with _RssPeak() as rss:
                if url is None:
                    t, moved = step_funnel(rollout, ranks, group_size)
                else:
                    t = step_dataplane(client, rollout, ranks, group_size, i)
                    after = meter.totals()
                    moved = int(after["bytes_get"] - before["bytes_get"] + after["bytes_put"] - before["bytes_put"])
            if i >= warmup:
                steps.append(t)
                peaks.append(rss.delta)
                driver_bytes.append(moved)
    finally:
        if client is not None:
            client.close()
        for a in [rollout, *ranks]:
            ray.kill(a)
    phases = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    return {
        "size_bytes": size,
        "step_seconds": statistics.median(sum(s.values()) for s in steps),
        "phases": phases,
        "driver_bytes": int(statistics.median(driver_bytes)),
        "driver_peak_rss_delta_bytes": int(max(peaks)),
        "repeat": repeat,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rl_step", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None, help="batch sizes in MB, comma separated (default 64,512)")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--backends", default="mooncake://local,tq://?backend=simple,tq://?backend=mooncake")
    a = p.parse_args(argv)
    sizes = [int(x) for x in (a.sizes or ("4" if a.quick else "64,512")).split(",")]
    repeat = a.repeat or (2 if a.quick else 5)
    from dataplane.local_ray import init_local_ray

    init_local_ray(num_cpus=8, log_to_driver=False)
    owners = {u: dataplane.connect(u) for u in a.backends.split(",") if u}
    try:
        for size in sizes:
            funnel = measure(None, size, repeat, 1)
            print(f"{size} MB driver_funnel: {funnel['step_seconds']:.3f} s {funnel['phases']} driver {funnel['driver_bytes']} rss {funnel['driver_peak_rss_delta_bytes']}")
            for url, owner in owners.items():
                r = measure(owner.url, size, repeat, 1)
                print(f"{size} MB {url}: {r['step_seconds']:.3f} s x{funnel['step_seconds'] / r['step_seconds']:.2f} {r['phases']} driver {r['driver_bytes']} rss {r['driver_peak_rss_delta_bytes']}")
    finally:
        for c in owners.values():
            c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
