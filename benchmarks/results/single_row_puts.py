"""Rows put one at a time into one partition (an asynchronous rollout worker streaming samples): the
time per put, averaged over each block of 500 puts, from the first block to the last, then one get
of every row (checked). With ``foreign`` instead: a master holding 20,000 small objects of someone
else, and per repetition a first put of a 16 MB batch into a fresh partition, a second put of it
(new keys) into that partition, a get by the second put's meta and a get of every 2nd row by keys.
With ``rollouts``: 256 RL-shaped rollouts (7 token fields of 500-2,500 tokens and a reward, ~13 MB
in all) put one per call, then the trainer's get of all of them by keys and a data-parallel rank's
get of every 4th (checked, medians of 5 after a warm-up), three rounds.

    python -m benchmarks.results.single_row_puts "mooncake://local?segment_bytes=1GiB"        # 3,000 puts, 8 fields
    python -m benchmarks.results.single_row_puts "mooncake://local?segment_bytes=1GiB" 3000 2
    python -m benchmarks.results.single_row_puts memory:// 3000 8
    python -m benchmarks.results.single_row_puts "mooncake://local?segment_bytes=1GiB" foreign
    python -m benchmarks.results.single_row_puts "mooncake://local?segment_bytes=1GiB" rollouts

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
ROLLOUT_DTYPES = (torch.int64, torch.int64, torch.float32, torch.float32, torch.float32, torch.bool, torch.bfloat16)


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


def rollouts(client: dataplane.DataPlaneClient, n: int = 256, repeat: int = 5, seed: int = 0) -> dict[str, float]:
    """Put ``n`` rollouts one per call (token fields of 500-2,500 tokens, a reward), then get all of
    them by keys, and every 4th; median seconds per put and per get, and the bytes of a whole get."""
    g = torch.Generator().manual_seed(seed)
    keys = [f"r{i}" for i in range(n)]
    names = [f"t{j}" for j in range(len(ROLLOUT_DTYPES))]
    sent: list[dict[str, torch.Tensor]] = []
    puts: list[float] = []
    try:
        for i, key in enumerate(keys):
            length = int(torch.randint(500, 2501, (1,), generator=g))
            row: dict[str, torch.Tensor] = {"reward": torch.tensor([float(i)])}
            for name, dtype in zip(names, ROLLOUT_DTYPES, strict=True):
                values = torch.randint(0, 1000, (length,), generator=g).to(dtype)
                row[name] = torch.nested.as_nested_tensor([values], layout=torch.jagged)
            sent.append(row)
            t0 = time.perf_counter()
            client.kv_batch_put([key], row, partition_id="rollouts")
            puts.append(time.perf_counter() - t0)
        fields = ["reward", *names]
        out: dict[str, float] = {"put": statistics.median(puts)}
        for label, want in (("get all", list(range(n))), ("get 1/4", list(range(0, n, 4)))):
            ks = [keys[i] for i in want]
            times = []
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                got = client.kv_batch_get(ks, partition_id="rollouts", select_fields=fields)
                times.append(time.perf_counter() - t0)
            if got["reward"].tolist() != [float(i) for i in want]:
                raise AssertionError(f"{label}: the rewards did not read back in the keys' order")
            for j, i in enumerate(want):
                for name in names:
                    if not torch.equal(got[name][j], sent[i][name][0]):
                        raise AssertionError(f"{label}: row {i} of {name} did not read back as put")
            out[label] = statistics.median(times[1:])
            if label == "get all":
                out["bytes"] = float(sum((t.values() if t.is_nested else t).nbytes for t in got.values()))
        return out
    finally:
        client.kv_clear(partition_id="rollouts")


def main() -> None:
    url = sys.argv[1]
    if sys.argv[2:3] == ["rollouts"]:
        n = int(sys.argv[3]) if len(sys.argv) > 3 else 256
        client = dataplane.connect(url)
        try:
            for seed in range(3):
                r = rollouts(client, n, seed=seed)
                print(
                    f"{n} rollouts ({r['bytes'] / 1e6:.1f} MB) put one per call: put {r['put'] * 1e3:.2f} ms, "
                    f"get all {r['get all'] * 1e3:.1f} ms, get 1/4 {r['get 1/4'] * 1e3:.1f} ms"
                )
        finally:
            client.close()
        return
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
