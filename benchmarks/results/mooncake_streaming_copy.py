"""Streamed copies in the store server: what they buy, what they cost, and ours against raw with them.

A ``mooncake://local`` store server moves every object with glibc's ``memcpy``. dataplane starts it
with copies of 256 KiB or more streamed past the caches (``dataplane.adapters.mooncake._servers.STREAMING_COPY_TUNABLE``)
and pads every object it writes over shared memory to whole pages (``dataplane.adapters.mooncake._index.OBJECT_ALIGN``).
One run measures:

1. ``memcpy``: 32 MB copies in a child process (the tunable is read when a process starts), with
   glibc's own threshold and streamed, at distances of the destination past the source within a page.
2. Two deployments side by side: ``streamed`` as dataplane starts it, and ``glibc`` with
   ``DATAPLANE_STREAMING_COPY=0`` (glibc's own threshold). On each, for an RL batch of 8 fields:
   - ``raw``: ``batch_put_from`` / ``batch_get_into`` of its 8 objects, each padded to whole pages
     and on a page in the client's arena;
   - ``raw odd``: the same objects at their own sizes, back to back (where Mooncake places an object
     in the segment then depends on every odd size before it);
   - ``ours``: ``kv_batch_put`` of the batch in ``client.empty()`` memory, ``kv_batch_get`` by its
     meta from another client of the deployment.
   Every contender puts then gets, in rotating order, each repetition; ratios are paired medians of
   baseline / contender (above 1: the contender is faster).

    python -m benchmarks.results.mooncake_streaming_copy [--sizes 16,128] [--repeat 20] [--out STEM]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MB = 1 << 20
DISTANCES = (0, 8, 64, 256, 512, 1024, 2048)
_MEMCPY = """
import ctypes, json, statistics, sys, time
import numpy as np
n = 32 << 20
a, b = np.ones(n + 16384, np.uint8), np.zeros(n + 16384, np.uint8)
sa, sb = (a.ctypes.data + 4095) // 4096 * 4096, (b.ctypes.data + 4095) // 4096 * 4096
out = {}
for d in json.loads(sys.argv[1]):
    ts = []
    for _ in range(11):
        t = time.perf_counter()
        ctypes.memmove(sb + d, sa, n)
        ts.append(time.perf_counter() - t)
    out[d] = statistics.median(ts[3:]) * 1e3
print(json.dumps(out))
"""
CONTENDERS = ("raw", "raw odd", "ours")
DEPLOYMENTS = ("streamed", "glibc")


def memcpy_part() -> dict[str, dict[str, float]]:
    """ms of a 32 MB copy per distance (bytes the destination lies past the source within a page)."""
    from dataplane.adapters.mooncake._servers import STREAMING_COPY_FROM, STREAMING_COPY_TUNABLE

    out = {}
    for name, tunables in (("glibc", None), ("streamed", f"{STREAMING_COPY_TUNABLE}={STREAMING_COPY_FROM:#x}")):
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        run = subprocess.run(
            [sys.executable, "-c", _MEMCPY, json.dumps(DISTANCES)], env=env, capture_output=True, text=True, check=True
        )
        out[name] = json.loads(run.stdout)
    return out


@contextlib.contextmanager
def _deployments(segment_gib: int) -> Iterator[dict[str, tuple[Any, Any]]]:
    """(owner, reader) of each deployment: ``streamed`` as dataplane starts it, ``glibc`` without."""
    import dataplane
    from dataplane.adapters.mooncake._servers import STREAMING_COPY_ENV

    with contextlib.ExitStack() as stack:
        out = {}
        for name in DEPLOYMENTS:
            saved = os.environ.get(STREAMING_COPY_ENV)
            os.environ[STREAMING_COPY_ENV] = "1" if name == "streamed" else "0"
            try:
                owner = stack.enter_context(dataplane.connect(f"mooncake://local?segment_bytes={segment_gib}GiB"))
            finally:
                if saved is None:
                    del os.environ[STREAMING_COPY_ENV]
                else:
                    os.environ[STREAMING_COPY_ENV] = saved
            reader = stack.enter_context(dataplane.connect(owner.store.join_url))  # type: ignore[attr-defined]
            out[name] = (owner, reader)
        yield out


def _server_tunables(owner: Any) -> str:
    """The GLIBC_TUNABLES the deployment's store server runs with ('' for none)."""
    pid = owner.store.deployment.server.pid
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.decode()[len("GLIBC_TUNABLES=") :] for e in env if e.startswith(b"GLIBC_TUNABLES=")), "")


def mooncake_part(sizes: list[int], repeat: int, segment_gib: int) -> dict[str, Any]:
    from benchmarks.backends_mooncake import RawMooncake, field_buffers, real_client_of
    from benchmarks.workload import in_client_memory, make_batch, same_fields

    results: dict[str, Any] = {}
    with _deployments(segment_gib) as deps, contextlib.ExitStack() as stack:
        results["store_server_tunables"] = {name: _server_tunables(owner) for name, (owner, _) in deps.items()}
        for size in sizes:
            batch = make_batch(size * MB, 8, seed=0)
            buffers = field_buffers(batch)
            want = b"".join(b.numpy().tobytes() for _, b in buffers)
            setups: dict[tuple[str, str], Any] = {}
            for dep, (owner, reader) in deps.items():
                store = owner.store
                for name, aligned in (("raw", True), ("raw odd", False)):
                    raw = RawMooncake(
                        store.master_address, 2 * size * MB + (8 << 20), real_client_of(store), page_aligned=aligned
                    )
                    stack.callback(raw.close)
                    raw.load(buffers)
                    setups[dep, name] = raw
                setups[dep, "ours"] = (owner, reader, in_client_memory(batch, owner))
            times: dict[str, list[float]] = {
                f"{d} {c} {op}": [] for d in DEPLOYMENTS for c in CONTENDERS for op in ("put", "get")
            }
            cases = [(d, c) for d in DEPLOYMENTS for c in CONTENDERS]
            exact = True
            for i in range(repeat + 2):
                for dep, name in cases[i % len(cases) :] + cases[: i % len(cases)]:
                    tag = f"sc{size}-{i}-{dep}-{name}".replace(" ", "_")
                    if name == "ours":
                        owner, reader, zc = setups[dep, name]
                        t0 = time.perf_counter()
                        meta = owner.kv_batch_put(list(zc.keys), zc.fields, partition_id=tag)
                        t1 = time.perf_counter()
                        got = reader.kv_batch_get(meta, select_fields=list(meta.fields))
                        t2 = time.perf_counter()
                        exact = exact and (i > 0 or same_fields(got, batch.fields))
                        del got
                        owner.kv_clear(partition_id=tag)
                        put_s, get_s = t1 - t0, t2 - t1
                    else:
                        raw = setups[dep, name]
                        keys = [f"{tag}/{n}" for n, _ in buffers]
                        put_s, get_s = raw.put(keys), raw.get(keys)
                        exact = exact and (i > 0 or raw.read_back().tobytes() == want)
                        raw.remove(keys)
                    if i >= 2:
                        times[f"{dep} {name} put"].append(put_s)
                        times[f"{dep} {name} get"].append(get_s)
            results[f"{size}MB"] = {
                "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                "paired": {
                    f"{op}: {a} over {b}": statistics.median(
                        x / y for x, y in zip(times[f"{b} {op}"], times[f"{a} {op}"], strict=True)
                    )
                    for op in ("put", "get")
                    for a, b in (
                        ("streamed ours", "streamed raw"),
                        ("glibc ours", "glibc raw"),
                        ("streamed ours", "glibc raw"),
                        ("streamed raw", "glibc raw"),
                        ("streamed raw odd", "streamed raw"),
                        ("glibc raw odd", "glibc raw"),
                    )
                },
                "bit_exact": exact,
            }
    return results


def main(argv: list[str] | None = None) -> int:
    from benchmarks.put_get import machine_info

    ap = argparse.ArgumentParser(prog="python -m benchmarks.results.mooncake_streaming_copy")
    ap.add_argument("--sizes", default="16,128", help="batch sizes in MB, comma-separated")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--segment-gib", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).with_name("mooncake_streaming_copy")), help="writes OUT.json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    report = {
        "benchmark": "mooncake_streaming_copy",
        "created_unix": time.time(),
        "config": {"sizes_mb": sizes, "repeat": args.repeat, "fields": 8, "distances": list(DISTANCES)},
        "machine": machine_info(),
        "memcpy_32MB_ms": memcpy_part(),
        **mooncake_part(sizes, args.repeat, args.segment_gib),
    }
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine",)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
