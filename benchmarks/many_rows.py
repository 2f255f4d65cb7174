"""``python -m benchmarks.many_rows``: one RL step on a batch of many rows, step by step.

On a ``--size-mb`` RL batch (``make_batch``, 8 fields) of N rows: the put; a write-back of one more
jagged field by the same keys (a reference model's log-probs); a get of every 2nd row by keys, all
fields; a write-back of another field by 8 data-parallel ranks (rank r writes every 8th row from r,
one put each); a get of every row, all fields (the newest field's rows alternate between the 8 puts
row by row); ``kv_list``; the clear. Medians of ``--repeat`` after a warm-up, every get checked
against what was put. What grows with the row count shows here, at a fixed byte count.
``mooncake://`` reads through a second client that joined the first one's deployment.

    python -m benchmarks.many_rows                        # memory and mooncake; 1,024 / 16,384 / 65,536 rows
    python -m benchmarks.many_rows --backends "memory://" --rows 1024 --repeat 2 --out /tmp/m
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.harness import add_out_argument, bench_main, machine_info, machine_line

MB = 1 << 20
DP = 8
STEPS = ("put", "write-back", "get 1/2", "8-rank write-back", "get all", "list", "clear")


def step_times(w: Any, r: Any, rows: int, size_mb: int, repeat: int) -> dict[str, float]:
    """Median seconds of each of :data:`STEPS` over ``repeat`` runs after one warm-up (``w`` writes,
    ``r`` reads and writes back); every get is checked against what was put (raising on a mismatch)."""
    from benchmarks.workload import make_batch

    b = make_batch(size_mb * MB, 8, seed=0, rows=rows)
    extra = next(v for v in b.fields.values() if isinstance(v, torch.Tensor) and v.is_nested)
    shares = [list(range(rank, rows, DP)) for rank in range(DP)]
    each = extra.unbind()
    parts = [torch.nested.as_nested_tensor([each[i] for i in mine], layout=torch.jagged) for mine in shares]
    t: dict[str, list[float]] = {k: [] for k in STEPS}
    for _ in range(repeat + 1):
        times = [time.perf_counter()]
        meta = w.kv_batch_put(b.keys, b.fields, partition_id="p")
        keys = list(meta.keys)
        times.append(time.perf_counter())
        r.kv_batch_put(keys, {"ref_lp": extra}, partition_id="p")
        times.append(time.perf_counter())
        half = r.kv_batch_get(keys[::2], partition_id="p", select_fields=[*meta.fields, "ref_lp"])
        times.append(time.perf_counter())
        for mine, part in zip(shares, parts, strict=True):
            r.kv_batch_put([keys[i] for i in mine], {"old_lp": part}, partition_id="p")
        times.append(time.perf_counter())
        whole = r.kv_batch_get(keys, partition_id="p", select_fields=[*meta.fields, "ref_lp", "old_lp"])
        times.append(time.perf_counter())
        listed = w.kv_list("p")
        times.append(time.perf_counter())
        w.kv_clear(partition_id="p")
        times.append(time.perf_counter())
        for k, (a, z) in zip(t, itertools.pairwise(times), strict=True):
            t[k].append(z - a)
        if [half["ref_lp"][i].tolist() for i in (0, -1)] != [each[0].tolist(), each[(rows - 1) // 2 * 2].tolist()]:
            raise AssertionError(f"{rows} rows: the get of every 2nd row did not read the write-back")
        for f in ("ref_lp", "old_lp"):
            if not (
                torch.equal(whole[f].values(), extra.values()) and torch.equal(whole[f].offsets(), extra.offsets())
            ):
                raise AssertionError(f"{rows} rows: the get of every row did not read {f} back as written")
        if len(listed["p"]) != rows:
            raise AssertionError(f"{rows} rows: kv_list shows {len(listed['p'])} rows")
    return {k: statistics.median(v[1:]) for k, v in t.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataplane

    machine = machine_info()
    results: dict[str, Any] = {}
    for url in args.backends:
        w = dataplane.connect(url)
        join = getattr(w.store, "join_url", "")  # mooncake://: a second client of the same deployment
        r = dataplane.connect(join) if join else w
        try:
            for rows in args.rows:
                med = step_times(w, r, rows, args.size_mb, args.repeat)
                results.setdefault(url, {})[str(rows)] = {f"{k}_ms": v * 1e3 for k, v in med.items()}
                print(f"{url} {rows} rows: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in med.items()), file=sys.stderr)
        finally:
            if r is not w:
                r.close()
            w.close()
    return {
        "benchmark": "many_rows",
        "config": {"size_mb": args.size_mb, "fields": 8, "rows": args.rows, "dp": DP, "repeat": args.repeat},
        "machine": machine,
        "results": results,
    }


def to_markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"# One RL step on a {c['size_mb']} MB batch of many rows",
        "",
        machine_line(report["machine"]),
        f"Medians of {c['repeat']} after a warm-up, ms. `write-back`: one more jagged field by the same keys; "
        f"`get 1/2`: every 2nd row by keys, all fields; `{c['dp']}-rank write-back`: another field, one put per "
        "rank of every 8th row; `get all`: every row, all fields.",
        "",
        "| backend | rows | " + " | ".join(STEPS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in STEPS) + " |",
    ]
    for url, cells in report["results"].items():
        for rows, cell in cells.items():
            lines.append(f"| `{url}` | {int(rows):,} | " + " | ".join(f"{cell[f'{k}_ms']:.1f}" for k in STEPS) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.many_rows", description=__doc__.split("\n\n")[0])
    backends = ["memory://"]
    if importlib.util.find_spec("mooncake") is not None:
        backends.append("mooncake://local?segment_bytes=1GiB")
    p.add_argument("--backends", type=lambda s: s.split(";"), default=backends, help="';'-separated URLs")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 16384, 65536])
    p.add_argument("--size-mb", type=int, default=16)
    p.add_argument("--repeat", type=int, default=4)
    add_out_argument(p)
    args = p.parse_args(argv)
    if min(args.rows) < 2 * DP or args.repeat < 1 or args.size_mb < 1:
        p.error(f"--rows must be at least {2 * DP}, --repeat and --size-mb positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
