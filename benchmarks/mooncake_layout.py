"""``python -m benchmarks.mooncake_layout``: which object layout moves an RL batch through Mooncake
fastest. The data behind the ``mooncake://`` adapter's layout (one object per field per put).

Raw Mooncake, no dataplane code on the timed path, on the same batch (``make_batch``: jagged token
fields and a ``[B]`` reward), in each of these layouts:

- ``row_field``: one object per (row, field), the layout a per-row key-value store suggests;
- ``field``: one object per field holding every row back to back (the adapter's data objects);
- ``field_index``: ``field`` plus one small index object written and read in the same batch call
  (what the adapter stores per put: its index lists keys, offsets and schema);
- ``put``: one object per put holding every field (``batch_put_from_multi_buffers`` from the
  field buffers; read back with ``batch_get_into``).

Two reads: ``get all`` reads every row of every field (a trainer reading the step's batch), ``get
shard`` every ``--shard``-th row of every field (one data-parallel rank's rows after token balancing
are scattered like this). ``row_field`` reads the shard's objects whole; the other layouts are timed
both ways a reader can take the rows out of a larger object: one byte range per row and field
(``get_into_ranges``), and the whole objects into a staging area followed by a local copy of the
rows (timed). Writes and reads go through one store server, over shared memory (a real client) and
over loopback TCP (``?shm=false``); every layout is timed in every repetition, in rotating order,
and every read is checked bit-exact against the batch on the first.

    python -m benchmarks.mooncake_layout                      # 1 / 16 / 128 MB, both transports
    python -m benchmarks.mooncake_layout --sizes 1 --repeat 3 --transports shm --out /tmp/l
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks.harness import add_out_argument, bench_main, machine_info, machine_line

MB = 1 << 20
LAYOUTS = ("row_field", "field", "field_index", "put")
INDEX_BYTES = 5 << 10  # the adapter's index object for 256 rows of 8 fields is about this size
TRANSPORTS = {"shm": "", "tcp": "&shm=false"}


class _Layout:
    """The objects of one batch in one layout: keys, where each object's bytes lie in the source
    arena (the batch's fields back to back, as ``RawMooncake.load`` puts them, then the index bytes),
    and the byte ranges of each row within the objects that hold several rows."""

    def __init__(self, name: str, fields: list[tuple[int, np.ndarray]], rows: int, nbytes: int) -> None:
        # fields: (offset of the field in the arena, byte offset of each of its rows + the end)
        self.name, self.rows = name, rows
        self.objects: list[tuple[str, list[tuple[int, int]]]] = []  # (key suffix, [(arena offset, bytes)])
        self.row_ranges: list[list[tuple[int, int, int]]] = []  # per multi-row object: (arena offset, in object, bytes)
        if name == "row_field":
            for j, (base, cuts) in enumerate(fields):
                for i in range(rows):
                    if cuts[i + 1] > cuts[i]:
                        self.objects.append((f"{j}/{i}", [(base + int(cuts[i]), int(cuts[i + 1] - cuts[i]))]))
            return
        at, put_ranges = 0, []
        for j, (base, cuts) in enumerate(fields):
            ranges = [(base + int(cuts[i]), int(cuts[i]), int(cuts[i + 1] - cuts[i])) for i in range(rows)]
            if name == "put":
                put_ranges += [(a, at + o, n) for a, o, n in ranges]
                at += int(cuts[-1])
            elif cuts[-1]:
                self.objects.append((f"{j}", [(base, int(cuts[-1]))]))
                self.row_ranges.append(ranges)
        if name == "put":
            self.objects.append(("all", [(base, int(cuts[-1])) for base, cuts in fields if cuts[-1]]))
            self.row_ranges.append(put_ranges)
        if name == "field_index":
            self.objects.append(("index", [(nbytes, INDEX_BYTES)]))

    def keys(self, prefix: str) -> list[str]:
        return [f"{prefix}/{suffix}" for suffix, _ in self.objects]

    def shard(self, shard_rows: list[int]) -> tuple[list[int], list[list[tuple[int, int, int]]]]:
        """A shard read's objects (indexes into ``objects``) and, for multi-row objects, the
        (arena offset, offset in object, bytes) of each of the shard's rows, every field."""
        if self.name == "row_field":
            rows = set(shard_rows)
            return [j for j, (suffix, _) in enumerate(self.objects) if int(suffix.split("/")[1]) in rows], []
        per_field = len(self.row_ranges[0]) // self.rows  # fields in one object: 1, or all of them for "put"
        ranges = [
            [r for f in range(per_field) for i in shard_rows if (r := rr[f * self.rows + i])[2]]
            for rr in self.row_ranges
        ]
        return list(range(len(self.row_ranges))), ranges


def _field_cuts(batch: Any) -> tuple[list[tuple[int, np.ndarray]], int]:
    """(arena offset, byte offset of each row + the end) of every field as ``RawMooncake.load`` lays them out."""
    import torch

    from benchmarks.backends_mooncake import field_specs

    out, at = [], 0
    rows = len(batch.keys)
    for _, dtype, inner, offsets in field_specs(batch):
        row_bytes = torch.empty((), dtype=dtype).element_size() * int(np.prod(inner, dtype=np.int64))
        cuts = (np.arange(rows + 1) if offsets is None else offsets.numpy()).astype(np.int64) * row_bytes
        out.append((at, cuts))
        at += int(cuts[-1])
    return out, rows


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def _batched(call: Any, keys: list[str], ptrs: list[int], sizes: list[int], *extra: Any) -> list[int]:
    """``call`` in chunks of the adapter's key limit (Mooncake fails batches over ~1-2K keys between
    processes)."""
    from dataplane.adapters.mooncake import MAX_KEYS_PER_CALL

    out: list[int] = []
    for a in range(0, len(keys), MAX_KEYS_PER_CALL):
        b = a + MAX_KEYS_PER_CALL
        out += call(keys[a:b], ptrs[a:b], sizes[a:b], *extra)
    return out


def _measure(
    raw: Any, lay: _Layout, prefix: str, shard_rows: list[int], stage_at: int, check: bool
) -> dict[str, float]:
    """One put, get of everything and shard gets of ``lay``; seconds. Raises on a failed or torn read.
    Reads land where the bytes lie in the source arena, so every check compares equal offsets."""
    st, cfg = raw.store, raw.cfg
    src, dst = int(raw.src.ctypes.data), int(raw.dst.ctypes.data)
    keys = lay.keys(prefix)
    if lay.name == "put":
        ((_, spans),) = lay.objects
        t_put, codes = _timed(
            lambda: st.batch_put_from_multi_buffers(keys, [[src + a for a, _ in spans]], [[n for _, n in spans]], cfg)
        )
        whole = [(0, sum(n for _, n in spans))]  # lands contiguous: the fields back to back, as loaded
    else:
        whole = [spans[0] for _, spans in lay.objects]
        t_put, codes = _timed(
            lambda: _batched(st.batch_put_from, keys, [src + a for a, _ in whole], [n for _, n in whole], cfg)
        )
    if any(c != 0 for c in codes):
        raise RuntimeError(f"{lay.name}: put failed: {sorted(set(codes))}")
    out = {"put": t_put}

    def check_spans(what: str, spans: list[tuple[int, int]]) -> None:
        if check and any(not np.array_equal(raw.dst[a : a + n], raw.src[a : a + n]) for a, n in spans):
            raise AssertionError(f"{lay.name}: {what} did not read its bytes back bit-exact")

    def clean() -> None:
        if check:
            raw.dst[:] = 0  # a check must not pass on an earlier read's bytes

    clean()
    sizes = [n for _, n in whole]
    out["get_all"], got = _timed(lambda: _batched(st.batch_get_into, keys, [dst + a for a, _ in whole], sizes))
    if got != sizes:
        raise RuntimeError(f"{lay.name}: get failed: {sorted(set(got) - set(sizes))}")
    check_spans("get all", whole)
    picked, ranges = lay.shard(shard_rows)
    if lay.name == "row_field":  # the shard's own objects, whole
        clean()
        ks, spans = [keys[j] for j in picked], [whole[j] for j in picked]
        sizes = [n for _, n in spans]
        out["get_shard_whole"], got = _timed(
            lambda: _batched(st.batch_get_into, ks, [dst + a for a, _ in spans], sizes)
        )
        if got != sizes:
            raise RuntimeError(f"row_field: get shard failed: {sorted(set(got) - set(sizes))}")
        check_spans("get shard", spans)
    else:
        spans = [(a, n) for rr in ranges for a, _, n in rr]
        clean()  # one byte range per row and field, straight to where the row belongs
        out["get_shard_ranges"], res = _timed(
            lambda: st.get_into_ranges(
                [dst],
                [[keys[j] for j in picked]],
                [[[a for a, _, _ in rr] for rr in ranges]],
                [[[o for _, o, _ in rr] for rr in ranges]],
                [[[n for _, _, n in rr] for rr in ranges]],
            )
        )
        if [list(x) for x in res[0]] != [[n for _, _, n in rr] for rr in ranges]:
            raise RuntimeError(f"{lay.name}: ranged get failed: {res[0]!r:.200}")
        check_spans("ranged get shard", spans)
        clean()  # whole objects into a staging area, then the shard's rows copied out of it
        ks = [keys[j] for j in picked]
        objs = [lay.objects[j][1] for j in picked]
        stage = [stage_at + (a if lay.name != "put" else 0) for (a, _), *_ in objs]
        sizes = [sum(n for _, n in spans_j) for spans_j in objs]

        def whole_then_gather() -> list[int]:
            got = _batched(st.batch_get_into, ks, [dst + s for s in stage], sizes)
            for s, rr in zip(stage, ranges, strict=True):
                for a, o, n in rr:
                    raw.dst[a : a + n] = raw.dst[s + o : s + o + n]
            return got

        out["get_shard_whole"], got = _timed(whole_then_gather)
        if got != sizes:
            raise RuntimeError(f"{lay.name}: whole get for the shard failed: {sorted(set(got) - set(sizes))}")
        check_spans("staged get shard", spans)
    codes = _batched(lambda k, _p, _s: st.batch_remove(k, True), keys, [0] * len(keys), [0] * len(keys))
    if any(c != 0 for c in codes):
        raise RuntimeError(f"{lay.name}: remove failed: {sorted(set(codes))}")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataplane
    from benchmarks.backends_mooncake import RawMooncake, deployment_of, field_buffers
    from benchmarks.workload import make_batch

    machine = machine_info()
    results: dict[str, Any] = {}
    rows_of: dict[str, int] = {}
    objects_of: dict[str, dict[str, int]] = {}
    for transport in args.transports:
        owner = dataplane.connect(f"mooncake://local?segment_bytes={args.segment_mib}MiB{TRANSPORTS[transport]}")
        dep = deployment_of(owner)
        try:
            for size in args.sizes:
                batch = make_batch(size * MB, args.fields, seed=0)
                bufs = field_buffers(batch)
                nbytes = sum(b.numel() for _, b in bufs)
                # source: the batch, then index bytes; destination: the same, then a staging area
                raw = RawMooncake(  # its layouts place every byte themselves
                    dep.master, 2 * nbytes + INDEX_BYTES, dep.real_client, page_aligned=False
                )
                try:
                    raw.load(bufs)
                    fields, rows = _field_cuts(batch)
                    layouts = [_Layout(name, fields, rows, nbytes) for name in LAYOUTS]
                    shard_rows = list(range(0, rows, args.shard))
                    rows_of[f"{size}MB"] = rows
                    objects_of[f"{size}MB"] = {lay.name: len(lay.objects) for lay in layouts}
                    times: dict[str, dict[str, list[float]]] = {n: {} for n in LAYOUTS}
                    for i in range(args.warmup + args.repeat):
                        order = layouts[i % len(layouts) :] + layouts[: i % len(layouts)]
                        for lay in order:
                            prefix = f"layout/{transport}/{size}/{lay.name}/{i}"
                            got = _measure(raw, lay, prefix, shard_rows, nbytes + INDEX_BYTES, i == 0)
                            got["get_shard"] = min(v for op, v in got.items() if op.startswith("get_shard_"))
                            if i >= args.warmup:
                                for op, sec in got.items():
                                    times[lay.name].setdefault(op, []).append(sec)
                    cell: dict[str, Any] = {}
                    for name in LAYOUTS:
                        cell[name] = {op: statistics.median(v) * 1e3 for op, v in times[name].items()}
                        for op in ("put", "get_all", "get_shard"):  # paired: field / this layout, per repetition
                            v = times[name][op]
                            cell[name][f"{op}_vs_field"] = statistics.median(
                                f / x for f, x in zip(times["field"][op], v, strict=True)
                            )
                    cell["bytes"] = nbytes
                    cell["shard_bytes"] = sum(n for rr in layouts[1].shard(shard_rows)[1] for _, _, n in rr)
                    results[f"{transport}/{size}MB"] = cell
                    print(f"{transport} {size} MB done", flush=True)
                finally:
                    raw.close()
        finally:
            owner.close()
    return {
        "benchmark": "mooncake_layout",
        "config": {
            "sizes_mb": args.sizes,
            "fields": args.fields,
            "rows": rows_of,
            "objects": objects_of,
            "shard": args.shard,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "index_bytes": INDEX_BYTES,
        },
        "machine": {**machine, "loadavg_after": os.getloadavg()},
        "results": results,
    }


def to_markdown(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["config"]
    lines = [
        "# Mooncake object layouts for an RL batch (raw Mooncake, no dataplane code timed)",
        "",
        machine_line(m),
        f"Batch: `make_batch(size, {c['fields']} fields)` (rows: "
        + ", ".join(f"{k} {v}" for k, v in c["rows"].items())
        + f"); medians of {c['repeat']} after {c['warmup']} warm-up, layouts in rotating order in every "
        "repetition, every read checked bit-exact on the first. One store server; `shm` = a real client "
        "reached through shared memory, `tcp` = a plain store server over loopback TCP. "
        f"`get shard` reads every {c['shard']}th row of every field (one data-parallel rank's rows): "
        "`row_field` reads those rows' objects; the others either read one byte range per row and field "
        "(`ranges`, `get_into_ranges`) or whole objects into a staging area and copy the rows out "
        "(`whole`, copy timed); `get shard` is the faster of the two in each repetition. "
        "`x / field` is the paired median of field's time over this layout's (above 1: faster than field).",
        "",
        "Objects per put: "
        + "; ".join(f"{k}: " + ", ".join(f"{n} {v}" for n, v in objs.items()) for k, objs in c["objects"].items())
        + ".",
        "",
        "| transport | size | layout | put ms | get all ms | get shard ms (ranges / whole) | put / field | "
        "get all / field | get shard / field |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, cell in report["results"].items():
        transport, size = key.split("/")
        for name in LAYOUTS:
            r = cell[name]
            ways = " / ".join(f"{r[k]:.2f}" if k in r else "–" for k in ("get_shard_ranges", "get_shard_whole"))
            lines.append(
                f"| {transport} | {size} | {name} | {r['put']:.2f} | {r['get_all']:.2f} | {r['get_shard']:.2f} "
                f"({ways}) | "
                f"{r['put_vs_field']:.2f} | {r['get_all_vs_field']:.2f} | {r['get_shard_vs_field']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mooncake_layout", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 128])
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--shard", type=int, default=4, help="get shard reads every N-th row")
    p.add_argument("--transports", type=lambda s: s.split(","), default=list(TRANSPORTS))
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--segment-mib", type=int, default=1024)
    add_out_argument(p)
    args = p.parse_args(argv)
    bad = [t for t in args.transports if t not in TRANSPORTS]
    if bad:
        p.error(f"--transports: unknown {bad}; choose from {sorted(TRANSPORTS)}")
    if args.shard < 1 or min(args.sizes) < 1:
        p.error("--shard and --sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
