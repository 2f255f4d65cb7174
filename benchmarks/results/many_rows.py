"""One RL step on a 16 MB batch of many rows: put, a write-back of one more field by the same keys,
a get of every 2nd row by keys (all fields), ``kv_list``, clear. Medians of 4 after a warm-up.

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


def main() -> None:
    url = sys.argv[1]
    sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,16384,65536").split(",")]
    w = dataplane.connect(url)
    r = dataplane.connect(w.store.join_url) if url.startswith("mooncake") else w  # type: ignore[attr-defined]
    for rows in sizes:
        b = make_batch(16 << 20, 8, seed=0, rows=rows)
        extra = next(v for v in b.fields.values() if isinstance(v, torch.Tensor) and v.is_nested)
        t: dict[str, list[float]] = {k: [] for k in ("put", "write-back", "get", "list", "clear")}
        for _ in range(5):
            t0 = time.perf_counter()
            meta = w.kv_batch_put(b.keys, b.fields, partition_id="p")
            t1 = time.perf_counter()
            r.kv_batch_put(list(meta.keys), {"ref_lp": extra}, partition_id="p")
            t2 = time.perf_counter()
            r.kv_batch_get(list(meta.keys)[::2], partition_id="p", select_fields=[*meta.fields, "ref_lp"])
            t3 = time.perf_counter()
            assert len(w.kv_list("p")["p"]) == rows
            t4 = time.perf_counter()
            w.kv_clear(partition_id="p")
            t5 = time.perf_counter()
            for k, v in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                t[k].append(v)
        print(
            rows, "rows:", ", ".join(f"{k} {statistics.median(v[1:]) * 1e3:.1f} ms" for k, v in t.items()), flush=True
        )
    if r is not w:
        r.close()
    w.close()


if __name__ == "__main__":
    main()
