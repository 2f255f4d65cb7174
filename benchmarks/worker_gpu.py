"""``python -m benchmarks.worker_gpu``: time to data-on-every-GPU, leader broadcast vs independent reads.

One replica group of ``--ranks`` GPUs (one process each, NCCL) fetches one ~``--gb`` GB RL-shaped shard
(per token: int64 ids, bf16 logprobs, fp32 advantages, bool mask; long-tailed lengths; a per-row fp32
reward) as jagged tensors onto each GPU. Each rank has its own ``memory://`` store holding the same rows,
so an independent read costs what a read from a local store costs. Measured in the same run:

* ``independent_single``: one rank reads and copies to its GPU while the others wait (the target's
  denominator: a single rank's independent fetch);
* ``independent_all``: every rank reads at once (time until the slowest has its data);
* ``leader_broadcast``: the leader reads, broadcasts, every rank materializes (until the slowest);
* ``nccl_broadcast``: a plain ``dist.broadcast`` of the same byte count (the ceiling of the
  broadcast step).

Medians of ``--repeat`` runs after ``--warmup``. Targets: leader_broadcast <= 1.2x independent_single;
broadcast step >= 50% of the NCCL ceiling.

    python -m benchmarks.worker_gpu --ranks 4 --gb 1          # a dated report in benchmarks/reports/
    python -m benchmarks.worker_gpu --ranks 2 --json /tmp/w.json --md /tmp/w.md
    python -m benchmarks.worker_gpu --ranks 1    # one GPU: benchmarks.gpu_path (fetch/write-back vs ceilings)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dataplane
from benchmarks.harness import default_out, machine_info
from dataplane.codec import offsets_from_lengths, to_nested
from dataplane.worker import DataPlaneWorkerMixin

BYTES_PER_TOKEN = 8 + 2 + 4 + 1
FIELDS = ["input_ids", "logprobs", "advantages", "mask", "reward"]


def lengths_for(total_tokens: int, rows: int, seed: int = 0) -> np.ndarray:
    """Long-tailed (log-normal) row lengths in [16, 32768] summing to about ``total_tokens``."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(mean=0.0, sigma=1.0, size=rows)
    scale = total_tokens / base.sum()
    for _ in range(8):
        lens: np.ndarray = np.clip(np.rint(base * scale), 16, 32768).astype(np.int64)
        scale *= total_tokens / max(int(lens.sum()), 1)
    return lens


def make_shard(total_tokens: int, rows: int) -> tuple[list[str], dict[str, Any]]:
    lens = lengths_for(total_tokens, rows)
    offsets = offsets_from_lengths(torch.from_numpy(lens))
    n = int(offsets[-1])
    g = torch.Generator().manual_seed(1)
    fields = {
        "input_ids": to_nested(torch.randint(0, 151_000, (n,), generator=g), offsets),
        "logprobs": to_nested(torch.rand(n, generator=g).to(torch.bfloat16), offsets),
        "advantages": to_nested(torch.randn(n, generator=g), offsets),
        "mask": to_nested(torch.rand(n, generator=g) > 0.1, offsets),
        "reward": torch.rand(rows, generator=g),
    }
    return [f"s{i}_g{i % 8}" for i in range(rows)], fields


class BenchWorker(DataPlaneWorkerMixin):
    def __init__(self, group: Any) -> None:
        self._group = group

    def replica_group(self) -> Any:
        return self._group


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    _sync(device)
    dist.all_reduce(torch.ones(1, device=device))
    _sync(device)


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=300)
    if args.cpu:  # smoke test of the harness without GPUs
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=timeout)
    group = dist.new_group(list(range(world)))
    t0 = time.perf_counter()
    keys, fields = make_shard(int(args.gb * 1e9 / BYTES_PER_TOKEN), args.rows)
    client = dataplane.connect("memory://")
    meta = client.kv_batch_put(keys, fields, partition_id="bench")
    del fields
    setup_s = time.perf_counter() - t0
    worker = BenchWorker(group)
    worker.setup_data_plane(client)
    worker.data_plane_sync_timing = True

    def fetch(policy: str, *, barrier: bool = True) -> float:
        if barrier:
            _barrier(device)
        t = time.perf_counter()
        td = worker.fetch(meta, select_fields=FIELDS, layout="jagged", policy=policy, device=device)  # type: ignore[arg-type]
        _sync(device)
        elapsed = time.perf_counter() - t
        del td
        return elapsed

    runs: dict[str, list[float]] = {k: [] for k in ("independent_single", "independent_all", "leader_broadcast")}
    bcast_steps: list[float] = []
    leader_stats: list[dict[str, Any]] = []
    payload = 0
    for i in range(args.warmup + args.repeat):
        keep = i >= args.warmup
        # one rank alone
        _barrier(device)
        single = fetch("independent", barrier=False) if rank == 0 else 0.0
        _barrier(device)
        single = _slowest(single, device)
        everyone = _slowest(fetch("independent"), device)
        leader = _slowest(fetch("leader_broadcast"), device)
        stats = worker.last_fetch_stats
        assert stats is not None
        step = _slowest(stats.broadcast_s, device)
        if rank == 0:
            payload = stats.broadcast_bytes
            if keep:
                leader_stats.append(stats.to_dict())
        if keep:
            runs["independent_single"].append(single)
            runs["independent_all"].append(everyone)
            runs["leader_broadcast"].append(leader)
            bcast_steps.append(step)
    nbytes = torch.tensor([payload], dtype=torch.int64, device=device)
    dist.broadcast(nbytes, src=0)
    raw = torch.empty(int(nbytes.item()), dtype=torch.uint8, device=device)
    if rank == 0:
        raw.random_(0, 256)
    ceiling: list[float] = []
    for i in range(args.warmup + args.repeat):
        _barrier(device)
        t = time.perf_counter()
        dist.broadcast(raw, src=dist.get_global_rank(group, 0), group=group)
        _sync(device)
        if i >= args.warmup:
            ceiling.append(_slowest(time.perf_counter() - t, device))
        else:
            _slowest(0.0, device)
    if rank == 0:
        report = {
            "runs": {k: _summary(v) for k, v in runs.items()},
            "broadcast_step": _summary(bcast_steps),
            "nccl_broadcast": _summary(ceiling),
            "broadcast_bytes": int(nbytes.item()),
            "store_bytes": leader_stats[-1]["store_bytes"] if leader_stats else 0,
            "rows": meta.size,
            "tokens": int(meta.total_tokens or 0),
            "max_len": max(meta.sequence_lengths or (0,)),
            "median_len": int(statistics.median(meta.sequence_lengths or (0,))),
            "setup_s": setup_s,
            "leader_stats_last": leader_stats[-1] if leader_stats else None,
        }
        with open(out_path, "w") as f:
            json.dump(report, f)
    client.close()
    dist.barrier()
    dist.destroy_process_group()


def markdown(report: dict[str, Any]) -> str:
    m, r, ratios = report["machine"], report["result"], report["ratios"]
    gb = 1e9
    lines = [
        "# Worker fetch on GPUs: leader broadcast vs independent reads",
        "",
        f"Machine: {m['ranks']} x {m['gpus'][0] if m['gpus'] else 'GPU'} (of {m['gpu_count']}), torch {m['torch']} "
        f"(CUDA {m['cuda']}, NCCL {m['nccl']}), Python {m['python']}, {m['cpu_count']} CPUs.",
        f"Shard: {r['rows']} rows, {r['tokens'] / 1e6:.1f} M tokens (median {r['median_len']}, max {r['max_len']}), "
        f"{r['broadcast_bytes'] / gb:.3f} GB on the wire; jagged layout onto every GPU; medians of "
        f"{report['config']['repeat']} runs after {report['config']['warmup']} warm-up.",
        "",
        "| what | median s | min s | max s |",
        "| --- | --- | --- | --- |",
    ]
    for name, t in [
        *r["runs"].items(),
        ("broadcast step (in leader_broadcast)", r["broadcast_step"]),
        ("plain NCCL broadcast, same bytes", r["nccl_broadcast"]),
    ]:
        lines.append(f"| {name} | {t['median_s']:.4f} | {t['min_s']:.4f} | {t['max_s']:.4f} |")
    lines += [
        "",
        f"- leader_broadcast / independent_single = **{ratios['leader_vs_single']:.3f}** (target <= 1.2: "
        f"{'met' if ratios['leader_vs_single'] <= 1.2 else 'missed'})",
        f"- leader_broadcast / independent_all = {ratios['leader_vs_all']:.3f}",
        f"- broadcast step {ratios['broadcast_gbps']:.1f} GB/s vs plain NCCL {ratios['nccl_gbps']:.1f} GB/s = "
        f"**{ratios['broadcast_vs_nccl']:.2f}** of the ceiling (target >= 0.5: "
        f"{'met' if ratios['broadcast_vs_nccl'] >= 0.5 else 'missed'})",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--ranks", type=int, default=0, help="GPUs in the replica group (default: up to 4)")
    p.add_argument("--gb", type=float, default=1.0, help="approximate shard size in GB")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="default: a dated report in benchmarks/reports/")
    p.add_argument("--md", default=None, help="default: beside the JSON")
    p.add_argument("--cpu", action="store_true", help="smoke-test the harness on CPU ranks over gloo")
    args = p.parse_args(argv)
    count = args.ranks if args.cpu and args.ranks else torch.cuda.device_count()
    world = args.ranks or min(count, 4)
    if not args.cpu and count >= 1 and world == 1:  # one GPU: its data path against its ceilings
        from benchmarks import gpu_path

        return gpu_path.main(
            [f"--gb={args.gb}", f"--rows={args.rows}", f"--warmup={args.warmup}", f"--repeat={args.repeat}"]
        )
    if count < 2 or world > count or world < 2:
        print(f"needs at least 2 CUDA GPUs and --ranks <= {count}; found {count}", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    machine = {
        **machine_info(gpus=True),
        "gpu_count": torch.cuda.device_count(),
        "ranks": world,
        "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    if args.json is None:
        args.json = str(default_out("worker_gpu", machine).with_suffix(".json"))
    if args.md is None:
        args.md = str(Path(args.json).with_suffix(".md"))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    tmp = f"{args.json}.rank0.tmp"
    spawn: Any = mp.start_processes  # type: ignore[attr-defined]
    spawn(rank_main, args=(world, port, args, tmp), nprocs=world, start_method="spawn", join=True)
    with open(tmp) as f:
        result = json.load(f)
    os.remove(tmp)
    nbytes = result["broadcast_bytes"]
    step = result["broadcast_step"]["median_s"]
    ceil = result["nccl_broadcast"]["median_s"]
    single = result["runs"]["independent_single"]["median_s"]
    ratios = {
        "leader_vs_single": result["runs"]["leader_broadcast"]["median_s"] / single,
        "leader_vs_all": result["runs"]["leader_broadcast"]["median_s"] / result["runs"]["independent_all"]["median_s"],
        "broadcast_gbps": nbytes / step / 1e9,
        "nccl_gbps": nbytes / ceil / 1e9,
        "broadcast_vs_nccl": ceil / step,
    }
    report = {
        "schema_version": 1,
        "benchmark": "worker_gpu",
        "config": {"ranks": world, "gb": args.gb, "rows": args.rows, "warmup": args.warmup, "repeat": args.repeat},
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.worker_gpu", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "result": result,
        "ratios": ratios,
        "targets": {
            "leader_vs_single_max": 1.2,
            "broadcast_vs_nccl_min": 0.5,
            "met": ratios["leader_vs_single"] <= 1.2 and ratios["broadcast_vs_nccl"] >= 0.5,
        },
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(args.md, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
