"""How close to raw Mooncake a checked, indexed ``mooncake://`` call can get at all: the floor.

Each figure below is a median over repetitions of a ratio timed back to back in one repetition, raw
over the contender (1.0: as fast as raw), with a 16 MB RL batch (8 fields) over this host's transport:

Get (a writer process puts, each repetition, the batch for every contender; this process reads):

- ``raw + check after``: raw ``batch_get_into`` of the batch's 8 objects, then one listing of the
  master's index keys, the round trip a get must make after its read (a clear may free an object
  while it is read; only a put still listed after the read is trusted). No Python of ours at all:
  the most any checked get can reach.
- ``raw + check beside``: the listing asked before the read and answered after it (what a get could
  do if the check did not have to follow the read).
- ``ours``: ``kv_batch_get`` by the meta the writer's put returned.

Put (this process):

- ``raw + index object``: raw ``batch_upsert_from`` of the 8 objects plus a 5 KB index object in the
  same call (what our put writes).
- ``ours_zc``: ``kv_batch_put`` of the batch built in ``client.empty()`` memory (no staging copy);
  its write alone (``ours_zc write``) is timed inside, so ``python before the write`` is the rest of
  the call (all but a few hundredths of a millisecond of it runs before the write).
- ``raw + ours_zc write`` (a ratio only): raw's write over ours' write alone, the most a put that
  writes as ours does could reach with no Python at all.

    python -m benchmarks.results.mooncake_floor [--size-mb 16] [--repeat 40] [--tcp] [--out STEM]
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
from benchmarks.results.mooncake_beside_gate import _put_by_writer

MB = 1 << 20
INDEX_BYTES = 4887  # the index object of a 16 MB batch of 256 rows in 8 fields


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ratios(out: dict[str, list[float]], base: str) -> dict[str, float]:
    """Median over repetitions of ``base`` / contender, timed in the same repetition."""
    return {
        name: statistics.median(b / v for b, v in zip(out[base], vals, strict=True))
        for name, vals in out.items()
        if name != base and len(vals) == len(out[base])
    }


RAW_GETS = ("raw", "raw + check after", "raw + check beside")


def _writer(url: str, master: str, real_client: str | None, conn: Connection, size: int) -> None:
    """Per repetition: our put of the batch, and one raw put of it for each raw contender, so every
    get reads objects written just before, by this process."""
    from benchmarks.backends_mooncake import RawMooncake, field_buffers
    from benchmarks.workload import make_batch

    try:
        with dataplane.connect(url) as client:
            batch = make_batch(size, 8)
            raw = RawMooncake(master, 2 * size + (64 << 20), real_client)
            raw.load(field_buffers(batch))
            names = [name for name, _ in field_buffers(batch)]
            while (pid := conn.recv()) is not None:
                for tag in RAW_GETS:
                    raw.put([f"{pid}/{tag}/{n}" for n in names])
                conn.send(("meta", client.kv_batch_put(list(batch.keys), batch.fields, partition_id=pid)))
            raw.close()
    except BaseException as e:  # the parent raises it instead of waiting for a meta that never comes
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _get_cases(
    raw: Any, admin: Any, lines: Any, reader: Any, keys: dict[str, list[str]], meta: Any
) -> dict[str, Callable[[], Any]]:
    """One repetition's get contenders, each reading its own objects."""

    def after() -> None:
        raw.get(keys["raw + check after"])
        admin.start_all_keys(10, lines)()

    def beside() -> None:
        answer = admin.start_all_keys(10, lines)
        raw.get(keys["raw + check beside"])
        answer()

    return {
        "raw": lambda: raw.get(keys["raw"]),
        "raw + check after": after,
        "raw + check beside": beside,
        "ours": lambda: reader.kv_batch_get(meta, select_fields=list(meta.fields)),
    }


def get_part(client: Any, size: int, repeat: int) -> dict[str, Any]:
    from benchmarks.backends_mooncake import RawMooncake, field_buffers, real_client_of
    from benchmarks.workload import make_batch, same_fields

    batch = make_batch(size, 8)
    names = [name for name, _ in field_buffers(batch)]
    raw = RawMooncake(client.store.master_address, 2 * size + (64 << 20), real_client_of(client.store))
    raw.sizes = [b.numel() for _, b in field_buffers(batch)]
    admin, lines = client.store.admin, client.store._index_lines
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    args = (client.store.join_url, client.store.master_address, real_client_of(client.store), there, size)
    writer = ctx.Process(target=_writer, args=args, daemon=True)
    writer.start()
    reader = dataplane.connect(client.store.join_url)
    out: dict[str, list[float]] = {name: [] for name in (*RAW_GETS, "ours")}
    try:
        for i in range(repeat + 3):
            pid = f"floor{i}"
            meta = _put_by_writer(here, pid)
            keys = {tag: [f"{pid}/{tag}/{n}" for n in names] for tag in RAW_GETS}
            cases = _get_cases(raw, admin, lines, reader, keys, meta)
            order = list(cases)[i % 4 :] + list(cases)[: i % 4]  # every contender leads in turn
            for name in order:
                seconds = _timed(cases[name])
                if i >= 3:
                    out[name].append(seconds)
            if i == 3 and not same_fields(reader.kv_batch_get(meta, select_fields=list(meta.fields)), batch.fields):
                raise AssertionError("a get returned other bytes than the writer put")
            reader.kv_clear(partition_id=pid)
            raw.store.remove_by_regex(f"^{pid}/", True)
    finally:
        here.send(None)
        writer.join(30)
        if writer.is_alive():
            writer.kill()
        reader.close()
        raw.close()
    return {"ms": {k: statistics.median(v) * 1e3 for k, v in out.items()}, "raw_over": _ratios(out, "raw")}


def _put_cases(raw: Any, client: Any, zc: Any, names: list[str], pid: str) -> dict[str, Callable[[], Any]]:
    """One repetition's put contenders, each writing new objects (raw's from its registered arena)."""
    ptrs, sizes = raw._ptrs(raw.src), raw.stored
    index_ptr = ptrs[-1] + sizes[-1] + 4096  # unused space of the registered source arena
    return {
        "raw": lambda: raw.store.batch_upsert_from([f"{n}.a" for n in names], ptrs, sizes, raw.cfg),
        "raw + index object": lambda: raw.store.batch_upsert_from(
            [f"{n}.b" for n in names] + [f"{pid}/index"], [*ptrs, index_ptr], [*sizes, INDEX_BYTES], raw.cfg
        ),
        "ours_zc": lambda: client.kv_batch_put(list(zc.keys), zc.fields, partition_id=pid),
    }


def put_part(client: Any, size: int, repeat: int) -> dict[str, Any]:
    from benchmarks.backends_mooncake import RawMooncake, field_buffers, real_client_of
    from benchmarks.workload import in_client_memory, make_batch

    batch = make_batch(size, 8)
    buffers = field_buffers(batch)
    zc = in_client_memory(batch, client)
    raw = RawMooncake(client.store.master_address, 2 * size + (64 << 20), real_client_of(client.store))
    out: dict[str, list[float]] = {"raw": [], "raw + index object": [], "ours_zc": [], "ours_zc write": []}
    with contextlib.ExitStack() as stack:
        stack.callback(raw.close)
        writes = stack.enter_context(timing_calls(client.store.handle, "put_from"))
        raw.load(buffers)
        for i in range(repeat + 3):
            cases = _put_cases(raw, client, zc, [f"floorput{i}/{name}" for name, _ in buffers], f"floorput{i}")
            order = list(cases)[i % 3 :] + list(cases)[: i % 3]
            for name in order:
                writes.clear()
                seconds = _timed(cases[name])
                if i >= 3:
                    out[name].append(seconds)
                    if name == "ours_zc":
                        out["ours_zc write"].append(writes[0])
            client.kv_clear(partition_id=f"floorput{i}")
            raw.store.remove_by_regex(f"^floorput{i}/", True)
    ms = {k: statistics.median(v) * 1e3 for k, v in out.items()}
    python = [t - w for t, w in zip(out["ours_zc"], out["ours_zc write"], strict=True)]
    ms["ours_zc python before the write"] = statistics.median(python) * 1e3
    ratios = _ratios({k: v for k, v in out.items() if k != "ours_zc write"}, "raw")
    # the most a put could reach that writes like ours and runs no Python at all
    ratios["raw + ours_zc write"] = statistics.median(
        r / w for r, w in zip(out["raw"], out["ours_zc write"], strict=True)
    )
    return {"ms": ms, "raw_over": ratios}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--tcp", action="store_true", help="plain TCP clients (no shared memory)")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args(argv)
    url = "mooncake://local?segment_bytes=4GiB" + ("&shm=false" if args.tcp else "")
    size = args.size_mb * MB
    with dataplane.connect(url) as client:
        result = {
            "machine": machine_info(),
            "size_mb": args.size_mb,
            "repeat": args.repeat,
            "transport": "tcp" if args.tcp else "shared memory",
            "get": get_part(client, size, args.repeat),
            "put": put_part(client, size, args.repeat),
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
