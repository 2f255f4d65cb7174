"""A/B of the Mooncake reader's cost-model constants (``dataplane.adapters.mooncake._read``) on the gets a
data-parallel rank makes: every dp-th row of a batch, all fields, over loopback TCP (the shared-memory
client reads whole objects only, so the model decides nothing there).

``old`` = 150 us per piece and 1.2 GB/s (the module's constants), ``new`` = 40 us and 2 GB/s (what
``benchmarks.mooncake_layout`` measures over loopback TCP on the 2-core VM).
Each repetition runs both, in alternating order, on the same rows (a rank chosen per repetition);
the figure is the paired median of old/new (above 1: new is faster). ``choices`` shows, per field,
whether each model read ranges (R) or whole objects and gathered (W). Run from the checkout's root:

    python -m benchmarks.results.mooncake_cost_model_ab 16 21
    python -m benchmarks.results.mooncake_cost_model_ab 128 13
"""

import statistics
import sys
import time

import torch

import dataplane
import dataplane.adapters.mooncake._read as R
from benchmarks.workload import make_batch, same_fields

size, reps = int(sys.argv[1]), int(sys.argv[2])
MODELS = {"old": (150e-6, 1.2e9), "new": (40e-6, 2e9)}
w = dataplane.connect("mooncake://local?segment_bytes=2GiB&shm=false")
r = dataplane.connect(w.store.join_url)
b = make_batch(size << 20, 8, seed=0)
meta = w.kv_batch_put(b.keys, b.fields, partition_id="ab")
fields, n = list(meta.fields), len(meta.keys)
choices: dict[tuple[int, str], str] = {}
plan_field = R.Reader._plan_field


def recording(self, field, res):  # type: ignore[no-untyped-def]
    col, ops, gathers = plan_field(self, field, res)
    recording.seen.append("R" if any(op.ranges for op in ops) else "W")
    return col, ops, gathers


recording.seen = []
R.Reader._plan_field = recording
times: dict[tuple[int, str], list[float]] = {}
for rep in range(reps + 1):
    for dp in (2, 4, 8, 16, 32):
        rows = list(range(rep % dp, n, dp))
        sub = meta.subset(rows)
        for name in ("old", "new") if rep % 2 else ("new", "old"):
            R._PIECE_S, R._NET_BPS = MODELS[name]
            recording.seen = []
            t0 = time.perf_counter()
            got = r.kv_batch_get(sub, select_fields=fields)
            dt = time.perf_counter() - t0
            choices[(dp, name)] = "".join(recording.seen)
            if rep == 0:  # warm-up, checked bit-exact
                want = {
                    f: b.fields[f][rows]
                    if not b.fields[f].is_nested
                    else torch.nested.as_nested_tensor([b.fields[f][i] for i in rows], layout=torch.jagged)
                    for f in fields
                }
                assert same_fields(got, want), (dp, name)
            else:
                times.setdefault((dp, name), []).append(dt)
print(f"{size} MB batch, {n} rows, {reps} repetitions (+1 warm-up, bit-exact checked)")
print("| ranks | rows read | old ms | new ms | old/new (paired) | choices old / new |")
print("| --- | --- | --- | --- | --- | --- |")
for dp in (2, 4, 8, 16, 32):
    o, nw = times[(dp, "old")], times[(dp, "new")]
    paired = statistics.median(a / c for a, c in zip(o, nw, strict=True))
    print(
        f"| {dp} | {len(range(0, n, dp))} | {statistics.median(o) * 1e3:.2f} | {statistics.median(nw) * 1e3:.2f} | "
        f"{paired:.2f} | {choices[(dp, 'old')]} / {choices[(dp, 'new')]} |"
    )
r.close()
w.close()
