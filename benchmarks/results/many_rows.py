"""One RL step on a 16 MB batch of many rows: put, a write-back of one more field by the same keys,
a get of every 2nd row by keys (all fields), a write-back of another field by 8 data-parallel ranks
(rank r writes every 8th row from r: one put each), a get of every row (all fields: the newest
field's rows alternate between the 8 puts row by row), ``kv_list``, clear. Medians of 4 after a
warm-up. With ``half`` after the sizes, only the get of every 2nd row, ten times over one put (a
trainer rank reading its share step after step), each time printed.

    python -m benchmarks.results.many_rows memory://
    python -m benchmarks.results.many_rows "mooncake://local?segment_bytes=1GiB" 1024,16384,65536
    python -m benchmarks.results.many_rows memory:// 16384 half

Mooncake's reader is a second client of the owner's deployment (another client, same process).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import torch

import dataplane
from benchmarks.workload import make_batch

_DP = 8


STEPS = ("put", "write-back", "get 1/2", "8-rank write-back", "get all", "list", "clear")


def step_times(w: dataplane.DataPlaneClient, r: dataplane.DataPlaneClient, rows: int, repeat: int) -> dict[str, float]:
    """Median seconds of each step over ``repeat`` runs after one warm-up; every get is checked
    against what was put (raising on a mismatch)."""
    b = make_batch(16 << 20, 8, seed=0, rows=rows)
    extra = next(v for v in b.fields.values() if isinstance(v, torch.Tensor) and v.is_nested)
    shares = [list(range(rank, rows, _DP)) for rank in range(_DP)]
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
        assert [half["ref_lp"][i].tolist() for i in (0, -1)] == [each[0].tolist(), each[(rows - 1) // 2 * 2].tolist()]
        for f in ("ref_lp", "old_lp"):
            assert torch.equal(whole[f].values(), extra.values()) and torch.equal(whole[f].offsets(), extra.offsets())
        assert len(listed["p"]) == rows
    return {k: statistics.median(v[1:]) for k, v in t.items()}


def half_gets(w: dataplane.DataPlaneClient, r: dataplane.DataPlaneClient, rows: int, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` gets of every 2nd row (all fields) of one put."""
    b = make_batch(16 << 20, 8, seed=0, rows=rows)
    meta = w.kv_batch_put(b.keys, b.fields, partition_id="p")
    keys = list(meta.keys)[::2]
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r.kv_batch_get(keys, partition_id="p", select_fields=list(meta.fields))
        out.append(time.perf_counter() - t0)
    w.kv_clear(partition_id="p")
    return out


def main() -> None:
    url = sys.argv[1]
    sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,16384,65536").split(",")]
    w = dataplane.connect(url)
    r = dataplane.connect(w.store.join_url) if url.startswith("mooncake") else w  # type: ignore[attr-defined]
    try:
        for rows in sizes:
            if sys.argv[3:] == ["half"]:
                print(rows, "rows, get 1/2:", " ".join(f"{t * 1e3:.1f}" for t in half_gets(w, r, rows, 10)), "ms")
                continue
            med = step_times(w, r, rows, repeat=4)
            print(rows, "rows:", ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items()), flush=True)
    finally:
        if r is not w:
            r.close()
        w.close()


if __name__ == "__main__":
    main()
