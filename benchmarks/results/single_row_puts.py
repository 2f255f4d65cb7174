"""Rows put one at a time into one partition (an asynchronous rollout worker streaming samples): the
time per put, averaged over each block of 500 puts, from the first block to the last, then one get
of every row (checked). With ``foreign`` instead: a master holding 20,000 small objects of someone
else, and per repetition a first put of a 16 MB batch into a fresh partition, a second put of it
(new keys) into that partition, a get by the second put's meta and a get of every 2nd row by keys.

    python -m benchmarks.results.single_row_puts "mooncake://local?segment_bytes=1GiB"        # 3,000 puts, 8 fields
    python -m benchmarks.results.single_row_puts "mooncake://local?segment_bytes=1GiB" 3000 2
    python -m benchmarks.results.single_row_puts memory:// 3000 8
    python -m benchmarks.results.single_row_puts "mooncake://local?segment_bytes=1GiB" foreign

Results of the code before and after a change, run one after the other on the 2-core VM, are in
``single_row_puts.md``.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import torch

import dataplane
from benchmarks.workload import make_batch

BLOCK = 500
FOREIGN = 20_000
STEPS = ("first put", "second put", "get by meta", "get 1/2 by keys")


def stream(client: dataplane.DataPlaneClient, n: int, fields: int, block: int = BLOCK) -> list[float]:
    """Put ``n`` single rows of ``fields`` fields (a 100-token jagged one, a scalar, 16-wide dense
    ones) into one partition; seconds per put, averaged per ``block`` puts. Reads every row back."""
    if fields < 2:
        raise ValueError("fields must be >= 2 (a jagged field and a scalar)")
    row = torch.arange(100)
    out: list[float] = []
    last = time.perf_counter()
    try:
        for i in range(n):
            send: dict[str, torch.Tensor] = {
                "ids": torch.nested.as_nested_tensor([row + i], layout=torch.jagged),
                "r": torch.tensor([float(i)]),
            }
            for j in range(fields - 2):
                send[f"f{j}"] = torch.full((1, 16), float(j))
            client.kv_batch_put([f"s{i}"], send, partition_id="stream")
            if (i + 1) % block == 0:
                now = time.perf_counter()
                out.append((now - last) / block)
                last = now
        got = client.kv_batch_get([f"s{i}" for i in range(n)], partition_id="stream", select_fields=["ids", "r"])
        if got["r"].tolist() != [float(i) for i in range(n)] or got["ids"].values().numel() != 100 * n:
            raise AssertionError("the streamed rows did not read back as put")
        if int(got["ids"][n - 1][99]) != 99 + n - 1:
            raise AssertionError("the last streamed row did not read back as put")
    finally:
        client.kv_clear(partition_id="stream")
    return out


def foreign(url: str, repeat: int = 15) -> dict[str, float]:
    """Median seconds of :data:`STEPS` with :data:`FOREIGN` foreign objects in the master."""
    w = dataplane.connect(url)
    r = dataplane.connect(w.store.join_url)  # type: ignore[attr-defined]
    try:
        handle = w.store.handle  # type: ignore[attr-defined]
        filler = w.empty((64,), torch.uint8)
        for lo in range(0, FOREIGN, 1000):
            keys = [f"foreign/{i}" for i in range(lo, min(FOREIGN, lo + 1000))]
            handle.put_from(keys, [filler.data_ptr()] * len(keys), [64] * len(keys))
        b = make_batch(16 << 20, 8, seed=0)
        t: dict[str, list[float]] = {k: [] for k in STEPS}
        for i in range(repeat + 2):
            pid = f"f{i}"
            times = [time.perf_counter()]
            w.kv_batch_put(b.keys, b.fields, partition_id=pid)
            times.append(time.perf_counter())
            again = [f"{k}/2" for k in b.keys]
            meta = w.kv_batch_put(again, b.fields, partition_id=pid)
            times.append(time.perf_counter())
            whole = r.kv_batch_get(meta, select_fields=list(meta.fields))
            times.append(time.perf_counter())
            half = r.kv_batch_get(again[::2], partition_id=pid, select_fields=list(meta.fields))
            times.append(time.perf_counter())
            first = next(iter(b.fields))
            if not torch.equal(whole[first].values(), b.fields[first].values()):  # type: ignore[union-attr]
                raise AssertionError("the get by meta did not read the batch back")
            if len(half[first].unbind()) != len(again[::2]):
                raise AssertionError("the get by keys did not read every 2nd row")
            w.kv_clear(partition_id=pid)
            if i >= 2:
                for k, (a, z) in zip(STEPS, itertools.pairwise(times), strict=True):
                    t[k].append(z - a)
        handle.remove_regex("^foreign/")
        return {k: statistics.median(v) for k, v in t.items()}
    finally:
        r.close()
        w.close()


def main() -> None:
    url = sys.argv[1]
    if sys.argv[2:] == ["foreign"]:
        med = foreign(url)
        print(f"{FOREIGN} foreign objects:", ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items()))
        return
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    fields = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    client = dataplane.connect(url)
    try:
        per = stream(client, n, fields)
    finally:
        client.close()
    print(f"{n} single-row puts of {fields} fields, ms per put per {BLOCK}:", " ".join(f"{x * 1e3:.2f}" for x in per))


if __name__ == "__main__":
    main()
