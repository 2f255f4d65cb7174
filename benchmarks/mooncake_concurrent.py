"""Aggregate throughput of several writers and readers at once: ours vs raw Mooncake.

An RL job has many rollout workers putting and several trainer ranks getting at the same time, so
each call's fixed Python cost overlaps other calls' transfers. ``--writers K`` spawned writer
processes each make ``--ops N`` copy-free puts of an RL-shaped batch back to back (ours:
``kv_batch_put`` of a batch built in ``client.empty()`` memory; raw: ``batch_put_from`` of the same
bytes from a registered buffer), all at once; then K reader processes each read one writer's N
batches back (ours: ``kv_batch_get`` by the returned metas, nested tensors out; raw:
``batch_get_into``). The figure is the total bytes over the wall time from the first command sent to
the last answer (ours' includes handing the metas to the readers, as a driver would), ours and raw
alternating in every repetition (paired ratios); the first repetition also checks what was read.

    python -m benchmarks.mooncake_concurrent                 # 16 and 128 MB, 2 writers + 2 readers
    python -m benchmarks.mooncake_concurrent --writers 4 --ops 4 --out /tmp/conc
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.harness import add_out_argument, bench_main, machine_info, machine_line, paired
from benchmarks.mooncake_xproc import DECODE_THREAD_ENV, TIMEOUT_S, WorkerProcess

MB = 1 << 20


def _round(
    writers: list[WorkerProcess], readers: list[WorkerProcess], c: str, size: int, n: int, tag: str, verify: bool
) -> tuple[float, float, bool]:
    """One put phase (every writer at once) and one get phase (every reader at once): wall seconds
    of each, and whether what was read is bit-exact."""
    tags = [f"{tag}-w{j}" for j in range(len(writers))]
    t0 = time.perf_counter()
    for w, t in zip(writers, tags, strict=True):
        w.send("put_loop" if c == "ours" else "raw_put_loop", size, t, n)
    got = [w.answer("put") for w in writers]
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r, t, g in zip(readers, tags, got, strict=True):
        if c == "ours":
            r.send("get_loop", size, g[1], verify)
        else:
            r.send("raw_get_loop", size, t, n, verify)
    read = [r.answer("get") for r in readers]
    get_s = time.perf_counter() - t0
    for w, t in zip(writers, tags, strict=True):
        w.call("clear_loop" if c == "ours" else "raw_clear_loop", *((t, n) if c == "ours" else (size, t, n)))
    return put_s, get_s, all(ok for _, ok in read)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataplane
    from benchmarks.backends_mooncake import deployment_of

    machine = machine_info()
    owner = dataplane.connect(
        f"mooncake://local?segment_bytes={args.segment_gib}GiB&shm={args.shm}", timeout_s=TIMEOUT_S
    )
    dep = deployment_of(owner)
    ctx = mp.get_context("spawn")
    arena = max(args.sizes) * MB * 2
    procs: list[WorkerProcess] = []
    times: dict[int, dict[str, dict[str, list[float]]]] = {}
    exact: dict[int, dict[str, bool]] = {}
    payloads: dict[int, int] = {}
    try:
        join = (owner.store.join_url, dep.master, dep.real_client, arena, args.fields)  # type: ignore[attr-defined]
        roles = [f"{role}{j}" for role in ("writer", "reader") for j in range(args.writers)]
        procs = WorkerProcess.start_all(ctx, roles, *join)
        writers, readers = procs[: args.writers], procs[args.writers :]
        for size in args.sizes:
            for j, (w, r) in enumerate(zip(writers, readers, strict=True)):  # reader j reads writer j's batch
                payloads[size] = w.call("batch", size, j)
                r.call("batch", size, j)
            t = times.setdefault(size, {c: {"put": [], "get": []} for c in ("ours", "raw")})
            for rep in range(args.warmup + args.repeat):
                for c in ("ours", "raw") if rep % 2 == 0 else ("raw", "ours"):
                    put_s, get_s, ok = _round(writers, readers, c, size, args.ops, f"c{size}-{c}-{rep}", rep == 0)
                    if rep == 0:
                        exact.setdefault(size, {})[c] = ok
                    if rep >= args.warmup:
                        t[c]["put"].append(put_s)
                        t[c]["get"].append(get_s)
                print(f"{size} MB rep {rep + 1}", file=sys.stderr, flush=True)
    finally:
        WorkerProcess.stop_all(procs)
        owner.close()
    results: dict[str, Any] = {}
    for size, t in times.items():
        total = payloads[size] * args.writers * args.ops
        cell: dict[str, Any] = {"payload_bytes": payloads[size], "bit_exact": exact.get(size, {})}
        for c, v in t.items():
            cell[c] = {
                op: {"median_s": statistics.median(xs), "gbps": total / statistics.median(xs) / 1e9}
                for op, xs in v.items()
            }
        for op in ("put", "get"):
            cell[f"{op}_ours_vs_raw_paired"] = paired(t["raw"][op], t["ours"][op])
        results[f"{size}MB"] = cell
    return {
        "schema_version": 1,
        "benchmark": "mooncake_concurrent"
        + ("" if args.writers == 2 else f"_{args.writers}w")
        + ("" if args.shm else "_tcp"),
        "created_unix": time.time(),
        "config": {
            "sizes_mb": args.sizes,
            "fields": args.fields,
            "writers": args.writers,
            "readers": args.writers,
            "ops_per_process": args.ops,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "segment_gib": args.segment_gib,
            "transport": "shared memory (real client)" if args.shm else "loopback TCP",
            "decode_thread_env": os.environ.get(DECODE_THREAD_ENV),
        },
        "machine": {**machine, "loadavg_after": os.getloadavg()},
        "results": results,
    }


def to_markdown(report: dict[str, Any]) -> str:
    m, cfg = report["machine"], report["config"]
    lines = [
        "# mooncake:// with several writers and readers at once: aggregate throughput, ours vs raw Mooncake",
        "",
        machine_line(m),
        f"{cfg['writers']} writer and {cfg['readers']} reader processes (spawned), the store server another; each "
        f"writer makes {cfg['ops_per_process']} copy-free puts of `make_batch(size, {cfg['fields']} fields)` back "
        "to back, all writers at once, then each reader gets one writer's batches back the same way. Aggregate "
        "GB/s = all bytes / wall time from the first command to the last answer; medians of "
        f"{cfg['repeat']} after {cfg['warmup']} warm-up, ours and raw alternating. Transport: {cfg['transport']}. "
        f"`$DATAPLANE_DECODE_THREAD`: {cfg.get('decode_thread_env') or 'unset (the default)'}.",
        "",
        "| size | contender | put GB/s | get GB/s | bit-exact |",
        "| --- | --- | --- | --- | --- |",
    ]
    for size, cell in report["results"].items():
        for c in ("ours", "raw"):
            lines.append(
                f"| {size} | {c} | {cell[c]['put']['gbps']:.2f} | {cell[c]['get']['gbps']:.2f} | "
                f"{cell['bit_exact'].get(c, '-')} |"
            )
    lines += ["", "| size | ours / raw, paired (95% CI) | put | get |", "| --- | --- | --- | --- |"]
    for size, cell in report["results"].items():
        p, g = cell["put_ours_vs_raw_paired"], cell["get_ours_vs_raw_paired"]
        lines.append(
            f"| {size} | n={p['n']} | **{p['median']:.2f}** ({p['low']:.2f}–{p['high']:.2f}) | "
            f"**{g['median']:.2f}** ({g['low']:.2f}–{g['high']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mooncake_concurrent", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128])
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--writers", type=int, default=2, help="writer processes, and as many readers")
    p.add_argument("--ops", type=int, default=8, help="puts per writer (gets per reader) in one round")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--segment-gib", type=int, default=3)
    p.add_argument(
        "--tcp", dest="shm", action="store_false", help="mooncake://local?shm=false: clients reach the store over TCP"
    )
    add_out_argument(p)
    args = p.parse_args(argv)
    need = args.writers * args.ops * max(args.sizes) * MB
    if need > args.segment_gib * (1 << 30) * 0.8:
        p.error(
            f"{args.writers} writers x {args.ops} ops x {max(args.sizes)} MB do not fit --segment-gib {args.segment_gib}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
