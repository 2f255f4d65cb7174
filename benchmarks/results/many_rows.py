"""One RL step on a 16 MB batch of many rows: put, a write-back of one more field by the same keys,
a get of every 2nd row by keys (all fields), a write-back of another field by 8 data-parallel ranks
(rank r writes every 8th row from r: one put each), a get of every row (all fields: the newest
field's rows alternate between the 8 puts row by row), ``kv_list``, clear. Medians of 4 after a
warm-up.

    python -m benchmarks.results.many_rows memory://
    python -m benchmarks.results.many_rows "mooncake://local?segment_bytes=1GiB" 1024,16384,65536

Mooncake's reader is a second client of the owner's deployment (another client, same process).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import dataplane
from benchmarks.workload import make_batch

_DP = 8


def main() -> None:
    url = sys.argv[1]
    sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,16384,65536").split(",")]
    w = dataplane.connect(url)
    r = dataplane.connect(w.store.join_url) if url.startswith("mooncake") else w  # type: ignore[attr-defined]
    for rows in sizes:
        b = make_batch(16 << 20, 8, seed=0, rows=rows)
        extra = next(v for v in b.fields.values() if isinstance(v, torch.Tensor) and v.is_nested)
        shares = [list(range(rank, rows, _DP)) for rank in range(_DP)]
        each = extra.unbind()
        parts = [torch.nested.as_nested_tensor([each[i] for i in mine], layout=torch.jagged) for mine in shares]
        steps = ("put", "write-back", "get 1/2", "8-rank write-back", "get all", "list", "clear")
        t: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(5):
            times = [time.perf_counter()]
            meta = w.kv_batch_put(b.keys, b.fields, partition_id="p")
            keys = list(meta.keys)
            times.append(time.perf_counter())
            r.kv_batch_put(keys, {"ref_lp": extra}, partition_id="p")
            times.append(time.perf_counter())
            r.kv_batch_get(keys[::2], partition_id="p", select_fields=[*meta.fields, "ref_lp"])
            times.append(time.perf_counter())
            for mine, part in zip(shares, parts, strict=True):
                r.kv_batch_put([keys[i] for i in mine], {"old_lp": part}, partition_id="p")
            times.append(time.perf_counter())
            out = r.kv_batch_get(keys, partition_id="p", select_fields=[*meta.fields, "ref_lp", "old_lp"])
            times.append(time.perf_counter())
            assert torch.equal(out["old_lp"].values(), extra.values())
            assert len(w.kv_list("p")["p"]) == rows
            times.append(time.perf_counter())
            w.kv_clear(partition_id="p")
            times.append(time.perf_counter())
            for k, a, z in zip(t, times, times[1:], strict=True):
                t[k].append(z - a)
        print(
            rows, "rows:", ", ".join(f"{k} {statistics.median(v[1:]) * 1e3:.1f} ms" for k, v in t.items()), flush=True
        )
    if r is not w:
        r.close()
    w.close()


if __name__ == "__main__":
    main()
