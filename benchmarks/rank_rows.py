"""``python -m benchmarks.rank_rows``: what one data-parallel rank's read of its rows costs.

A trainer with ``dp`` data-parallel ranks has each rank read every ``dp``-th row of the step's batch
(or any balanced share of them: scattered rows). Stores keep a put's rows back to back, so such a
read gathers one span per row and field: thousands of spans for a batch of thousands of rows. This
benchmark puts one RL batch (``make_batch``: jagged token fields and a ``[B]`` reward) and times, in
one process and interleaved, the get of the whole batch by its meta and one rank's get by the meta's
subset (the rank cycles between repetitions), for several row counts at one batch size. Every read
is checked bit-exact against the batch once. ``mooncake://`` reads through a second client that
joined the first one's deployment.

    python -m benchmarks.rank_rows                      # memory, mooncake over shm and TCP; a dated report
    python -m benchmarks.rank_rows --backends memory:// --rows 256 --repeat 3 --out /tmp/r
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.harness import add_out_argument, bench_main, machine_info, machine_line

MB = 1 << 20
BACKENDS = ["memory://", "mooncake://local?segment_bytes=2GiB", "mooncake://local?segment_bytes=2GiB&shm=false"]


def _shard(fields: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for name, v in fields.items():
        if v.is_nested:
            every = v.unbind()  # once: indexing a nested tensor row by row unbinds it every time
            out[name] = torch.nested.as_nested_tensor([every[i] for i in rows], layout=torch.jagged)
        else:
            out[name] = v[rows]
    return out


def _one_backend(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import dataplane
    from benchmarks.workload import make_batch, same_fields

    writer = dataplane.connect(url)
    join = getattr(writer.store, "join_url", "")
    reader = dataplane.connect(join) if join else writer
    cells: dict[str, Any] = {}
    try:
        for n_rows in args.rows:
            batch = make_batch(args.size_mb * MB, args.fields, rows=n_rows, seed=0)
            pid = f"rank_rows_{n_rows}"
            meta = writer.kv_batch_put(batch.keys, batch.fields, partition_id=pid)
            names = list(meta.fields)
            times: dict[str, list[float]] = {"whole": []}
            for dp in args.dp:
                times[f"dp{dp}"] = []
            for i in range(args.warmup + args.repeat):
                for name in times:
                    dp = 1 if name == "whole" else int(name[2:])
                    rank = i % dp
                    rows = list(range(rank, n_rows, dp))
                    sub = meta if dp == 1 else meta.subset(rows)
                    t0 = time.perf_counter()
                    got = reader.kv_batch_get(sub, select_fields=names)
                    dt = time.perf_counter() - t0
                    if i == 0:
                        want = batch.fields if dp == 1 else _shard(batch.fields, rows)
                        if not same_fields(got, want):
                            raise AssertionError(f"{url} rows={n_rows} {name}: the get is not bit-exact")
                    del got
                    if i >= args.warmup:
                        times[name].append(dt)
            whole_ms = statistics.median(times["whole"]) * 1e3
            cell: dict[str, Any] = {"whole_ms": whole_ms}
            for name, ts in times.items():
                if name == "whole":
                    continue
                ms = statistics.median(ts) * 1e3
                cell[f"{name}_ms"] = ms
                cell[f"{name}_vs_whole"] = ms / whole_ms
            cells[str(n_rows)] = cell
            print(f"{url} rows={n_rows}: " + ", ".join(f"{k} {v:.3g}" for k, v in cell.items()), flush=True)
            writer.kv_clear(partition_id=pid)
    finally:
        if reader is not writer:
            reader.close()
        writer.close()
    return cells


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = machine_info()
    results = {url: _one_backend(url, args) for url in args.backends}
    return {
        "benchmark": "rank_rows",
        "config": {k: getattr(args, k) for k in ("size_mb", "fields", "rows", "dp", "repeat", "warmup")},
        "machine": {**machine, "loadavg_after": os.getloadavg()},
        "results": results,
    }


def to_markdown(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["config"]
    dps = c["dp"]
    lines = [
        "# One data-parallel rank's read of its rows",
        "",
        machine_line(m),
        f"Batch: `make_batch({c['size_mb']} MB, {c['fields']} fields, rows=N)`; one process; medians of "
        f"{c['repeat']} after {c['warmup']} warm-up, reads interleaved. `whole`: the get of every row by the "
        "put's meta; `dpK`: the get of every K-th row (rank r of K, cycling) by the meta's subset, and its time "
        "relative to the whole get's.",
        "",
        "| backend | rows | whole ms | " + " | ".join(f"dp{d} ms | dp{d} / whole" for d in dps) + " |",
        "| --- | --- | --- | " + " | ".join("--- | ---" for _ in dps) + " |",
    ]
    for url, cells in report["results"].items():
        for n_rows, cell in cells.items():
            parts = [f"{cell[f'dp{d}_ms']:.2f} | {cell[f'dp{d}_vs_whole']:.2f}" for d in dps]
            lines.append(f"| `{url}` | {n_rows} | {cell['whole_ms']:.2f} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    p = argparse.ArgumentParser(prog="python -m benchmarks.rank_rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", type=lambda s: s.split(";"), default=BACKENDS, help="';'-separated URLs")
    p.add_argument("--size-mb", type=int, default=16)
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--rows", type=ints, default=[256, 1024, 4096])
    p.add_argument("--dp", type=ints, default=[2, 8])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    add_out_argument(p)
    args = p.parse_args(argv)
    if min(args.dp) < 2 or min(args.rows) < max(args.dp):
        p.error("--dp values must be >= 2 and --rows at least the largest dp")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
