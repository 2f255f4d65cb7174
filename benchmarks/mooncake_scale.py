"""``python -m benchmarks.mooncake_scale``: how a ``mooncake://`` put and get slow down as the master
holds more objects that are not theirs.

Every put and get of the adapter lists the master's keys once (``/get_all_keys``, the only listing
Mooncake offers: there is no prefix query), so their cost grows with everything the master holds:
other jobs' objects, a KV cache sharing the master, this job's own unconsumed partitions. This
benchmark fills the master with small foreign objects, level by level, and at each level times, in
one process, interleaved: the bare listing, our put of an RL batch, our get of it by its meta from
a second client, a second put of the batch (new keys) into the same partition (which asks the master
only whether the writer's first put is still there, not for its whole listing), and raw Mooncake's
``batch_get_into`` of the same bytes (which lists nothing).

    python -m benchmarks.mooncake_scale                       # 0 / 1k / 10k / 50k objects, writes a dated report
    python -m benchmarks.mooncake_scale --levels 0,200 --repeat 3 --out /tmp/s
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
FILLER_BYTES = 64


def _fill(raw: Any, have: int, target: int) -> None:
    """Put foreign objects ``filler/{have..target-1}`` (64 bytes each, hard-pinned) with raw Mooncake."""
    ptr = int(raw.src.ctypes.data)
    for lo in range(have, target, 1000):
        keys = [f"filler/{i}" for i in range(lo, min(lo + 1000, target))]
        codes = raw.store.batch_put_from(keys, [ptr] * len(keys), [FILLER_BYTES] * len(keys), raw.cfg)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"filling the master failed: {sorted(set(codes))}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataplane
    from benchmarks.backends_mooncake import RawMooncake, deployment_of, field_buffers
    from benchmarks.workload import make_batch, same_fields
    from dataplane.adapters.mooncake import DEPLOYMENT_KEY, AdminClient

    machine = machine_info()
    batch = make_batch(args.size_mb * MB, args.fields, seed=0)
    writer = dataplane.connect(f"mooncake://local?segment_bytes={args.segment_mib}MiB")
    reader = dataplane.connect(writer.store.join_url)  # type: ignore[attr-defined]
    dep = deployment_of(writer)
    raw = RawMooncake(dep.master, 2 * args.size_mb * MB + FILLER_BYTES, dep.real_client)
    admin = AdminClient(dep.master.rpartition(":")[0], dep.metrics_port)  # the master's admin port
    try:
        bufs = field_buffers(batch)
        raw.load(bufs)
        results: dict[str, Any] = {}
        have = 0
        for level in args.levels:
            _fill(raw, have, level)
            have = level
            t: dict[str, list[float]] = {"listing": [], "put": [], "get": [], "put_again": [], "raw_get": []}
            for i in range(args.warmup + args.repeat):
                keep = i >= args.warmup
                pid = f"scale{level}_{i}"
                t0 = time.perf_counter()
                n_keys = sum(1 for k in admin.all_keys(30.0) if k and k != DEPLOYMENT_KEY)  # not the deployment's token
                t1 = time.perf_counter()
                meta = writer.kv_batch_put(batch.keys, batch.fields, partition_id=pid)
                t2 = time.perf_counter()
                got = reader.kv_batch_get(meta, select_fields=list(meta.fields))
                t3 = time.perf_counter()
                if not same_fields(got, batch.fields):
                    raise AssertionError(f"level {level}: the get did not return the batch bit-exact")
                del got
                again = [f"{k}/2" for k in batch.keys]
                t4 = time.perf_counter()
                meta2 = writer.kv_batch_put(again, batch.fields, partition_id=pid)
                t5 = time.perf_counter()
                if list(meta2.keys) != again or sorted(writer.kv_list(pid)[pid]) != sorted([*batch.keys, *again]):
                    raise AssertionError(f"level {level}: the second put did not land beside the first")
                writer.kv_clear(partition_id=pid)
                raw_keys = [f"raw/{pid}/{n}" for n, _ in bufs]
                raw.put(raw_keys)
                raw_get_s = raw.get(raw_keys)
                raw.remove(raw_keys)
                if keep:
                    for name, v in (
                        ("listing", t1 - t0),
                        ("put", t2 - t1),
                        ("get", t3 - t2),
                        ("put_again", t5 - t4),
                        ("raw_get", raw_get_s),
                    ):
                        t[name].append(v)
            results[str(level)] = {
                "listed_keys": n_keys,
                **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in t.items()},
            }
            print(f"{level:>7} other objects: " + ", ".join(f"{k} {v:.4g}" for k, v in results[str(level)].items()))
        return {
            "benchmark": "mooncake_scale",
            "config": {
                "size_mb": args.size_mb,
                "fields": args.fields,
                "rows": len(batch.keys),
                "repeat": args.repeat,
                "warmup": args.warmup,
                "filler_bytes": FILLER_BYTES,
            },
            "machine": {**machine, "loadavg_after": os.getloadavg()},
            "results": results,
        }
    finally:
        admin.close()
        raw.store.remove_by_regex("^filler/", True)
        raw.close()
        reader.close()
        writer.close()


def to_markdown(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["config"]
    lines = [
        "# mooncake:// put and get vs the number of objects the master holds",
        "",
        machine_line(m),
        f"Batch: `make_batch({c['size_mb']} MB, {c['fields']} fields)`, {c['rows']} rows; one process, two clients "
        f"(writer, reader by meta) over shared memory; medians of {c['repeat']} after {c['warmup']} warm-up. "
        f"Other objects: {c['filler_bytes']}-byte objects under a foreign prefix, as another job or a KV cache "
        "sharing the master would hold. `listing` is one `/get_all_keys` round trip; `put` is the first put "
        "into a fresh partition (it lists), `put again` the writer's second put into it (new keys; it asks "
        "only whether its first put is still there); `raw_get` is raw `batch_get_into` of the same bytes "
        "(lists nothing).",
        "",
        "| other objects | keys listed | listing ms | put ms | put again ms | get ms | raw get ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for level, r in report["results"].items():
        lines.append(
            f"| {int(level):,} | {r['listed_keys']:,} | {r['listing_ms']:.2f} | {r['put_ms']:.2f} | "
            f"{r['put_again_ms']:.2f} | {r['get_ms']:.2f} | {r['raw_get_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mooncake_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1000, 10000, 50000])
    p.add_argument("--size-mb", type=int, default=1)
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--segment-mib", type=int, default=1024)
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.levels != sorted(args.levels) or min(args.levels) < 0:
        p.error("--levels must be non-negative and ascending (objects are added, never removed, between levels)")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
