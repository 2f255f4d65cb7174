"""Python run beside a Mooncake read: what it costs the read, and what the get's gate (planning and
decoding start 0.3 ms after the read is issued, ``dataplane.adapters.mooncake._get._Gate``) wins.

Part ``raw``: one client reads a 16 MB RL batch (8 objects) with raw ``batch_get_into`` over shared
memory while a helper thread of the same process runs Python (a 0.6 ms busy loop, or a get's
decode of the same batch), starting at once or after a delay. Part ``get``: a writer process puts
the batch, this process gets it by the meta (``kv_batch_get``) with the decode in line, beside with
the gate turned off, and beside with the gate held (whatever this host's CPU count; the adapter holds
it only below 4 CPUs); contenders alternate per repetition, and each get is checked bit-exact.

    python -m benchmarks.results.mooncake_beside_gate [--repeat 40] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import dataplane
from benchmarks.base import timing_calls
from benchmarks.put_get import machine_info
from dataplane._host.threads import Helper
from dataplane.adapters.mooncake import _get

MB = 1 << 20
RESULTS = Path(__file__).resolve().parent


WRITER_TIMEOUT_S = 120.0


def _writer(url: str, conn: Connection, size: int) -> None:
    from benchmarks.workload import make_batch

    try:
        with dataplane.connect(url) as client:
            batch = make_batch(size, 8)
            while (pid := conn.recv()) is not None:
                conn.send(("meta", client.kv_batch_put(list(batch.keys), batch.fields, partition_id=pid)))
    except BaseException as e:  # the parent raises it instead of waiting for a meta that never comes
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _put_by_writer(conn: Connection, pid: str) -> Any:
    """The meta of the writer process's put into ``pid``; raises what the writer raised, or on a timeout."""
    conn.send(pid)
    if not conn.poll(WRITER_TIMEOUT_S):
        raise TimeoutError(f"the writer process returned no meta within {WRITER_TIMEOUT_S}s")
    kind, value = conn.recv()
    if kind != "meta":
        raise RuntimeError(f"the writer process failed: {value}")
    return value


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def raw_part(client: Any, size: int, repeat: int) -> dict[str, float]:
    """Median ms of a raw read with each kind of Python beside it."""
    from benchmarks.backends_mooncake import RawMooncake, field_buffers, real_client_of
    from benchmarks.workload import make_batch
    from dataplane.codec.wire import Column, decode_columns, encode_fields

    batch = make_batch(size, 8)
    buffers = field_buffers(batch)
    raw = RawMooncake(client.store.master_address, 2 * size + (64 << 20), real_client_of(client.store))
    cols = encode_fields(batch.fields, len(batch.keys))

    def decode() -> None:  # what a get decodes: fresh offsets, so nothing is cached from the last one
        fresh = {
            k: Column(c.schema, c.values, None if c.offsets is None else c.offsets.clone()) for k, c in cols.items()
        }
        decode_columns(fresh, len(batch.keys))

    def after(delay: float, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            time.sleep(delay)
            work()

        return run

    works: dict[str, Callable[[], None] | None] = {
        "nothing beside": None,
        "0.6 ms busy loop at once": lambda: _spin(0.0006),
        "decode at once": decode,
        "0.6 ms busy loop after 0.1 ms": after(0.0001, lambda: _spin(0.0006)),
        "0.6 ms busy loop after 0.3 ms": after(0.0003, lambda: _spin(0.0006)),
        "decode after 0.3 ms": after(0.0003, decode),
    }
    helper = Helper("beside-gate")
    out: dict[str, list[float]] = {k: [] for k in works}
    try:
        raw.load(buffers)
        keys = [f"gate/{name}" for name, _ in buffers]
        raw.put(keys)
        for i in range(repeat + 3):
            for name, work in works.items():
                task = None if work is None else helper.submit(work)
                seconds = raw.get(keys)
                if task is not None:
                    task.result(10)
                if i >= 3:
                    out[name].append(seconds)
        raw.remove(keys)
    finally:
        helper.close()
        raw.close()
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def get_part(client: Any, size: int, repeat: int) -> dict[str, dict[str, float]]:
    """Median ms of a get by meta (and of its read alone) in line, beside ungated, beside gated."""
    from benchmarks.workload import make_batch, same_fields

    want = make_batch(size, 8).fields  # what the writer puts (the batch is seeded)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(client.store.join_url, there, size), daemon=True)
    writer.start()
    reader = dataplane.connect(client.store.join_url)
    timed = contextlib.ExitStack()
    reads = timed.enter_context(timing_calls(reader.store.handle, "get_into"))  # type: ignore[attr-defined]
    helper = Helper("dataplane-decode")
    modes = ("in line", "beside, no gate", "beside, gate")
    got: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in modes}
    min_bytes, below = _get._BESIDE_MIN_BYTES, _get._BESIDE_GATED_BELOW_CPUS
    try:
        for i in range(repeat + 3):
            for mode in modes:
                reader._beside = None if mode == "in line" else helper  # type: ignore[attr-defined]
                _get._BESIDE_MIN_BYTES = 1 << 62 if mode == "beside, no gate" else min_bytes
                _get._BESIDE_GATED_BELOW_CPUS = 1 << 30  # held on any host where the size says so
                pid = f"gate{i}-{mode}"
                meta = _put_by_writer(here, pid)
                t0 = time.perf_counter()
                out = reader.kv_batch_get(meta, select_fields=list(meta.fields))
                seconds = time.perf_counter() - t0
                if not same_fields(out, want):
                    raise RuntimeError(f"{mode}: a field read back wrong")
                if i >= 3:
                    got[mode][0].append(seconds)
                    got[mode][1].append(reads[-1])
                reader.kv_clear(partition_id=pid)
    finally:
        _get._BESIDE_MIN_BYTES, _get._BESIDE_GATED_BELOW_CPUS = min_bytes, below
        with contextlib.suppress(OSError):  # a writer that died has closed its end
            here.send(None)
        writer.join(30)
        helper.close()
        timed.close()
        reader.close()
    return {
        m: {"get_ms": statistics.median(g) * 1e3, "read_ms": statistics.median(r) * 1e3} for m, (g, r) in got.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--size-mb", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "mooncake_beside_gate"))
    args = ap.parse_args()
    size = args.size_mb * MB
    with dataplane.connect("mooncake://local?segment_bytes=4GiB") as client:
        report = {
            "machine": machine_info(),
            "size_mb": args.size_mb,
            "repeat": args.repeat,
            "gate": {"after_s": _get._BESIDE_AFTER_S, "min_bytes": _get._BESIDE_MIN_BYTES},
            "raw_read_ms": raw_part(client, size, args.repeat),
            "get_by_meta": get_part(client, size, args.repeat),
        }
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    lines = [
        "# Python beside a Mooncake read, and the get's gate",
        "",
        f"Machine: {m['cpu_count']} CPUs, {m.get('mem_total_gib')} GiB, {m['platform']}, torch {m['torch']}. "
        f"{args.size_mb} MB RL batch (8 objects), shared memory, medians of {args.repeat} after 3 warm-up, "
        "contenders alternating. `python -m benchmarks.results.mooncake_beside_gate`.",
        "",
        "| raw `batch_get_into`, with on a helper thread of the same process | read ms |",
        "| --- | --- |",
        *(f"| {k} | {v:.2f} |" for k, v in report["raw_read_ms"].items()),
        "",
        "| get by meta from another process's put | get ms | its read ms |",
        "| --- | --- | --- |",
        *(f"| {k} | {v['get_ms']:.2f} | {v['read_ms']:.2f} |" for k, v in report["get_by_meta"].items()),
        "",
    ]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
