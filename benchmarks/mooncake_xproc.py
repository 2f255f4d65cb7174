"""``python -m benchmarks.mooncake_xproc``: RL batches between processes through ``mooncake://``.

A writer process puts an RL-shaped batch (``benchmarks.workload.make_batch``); a different reader
process gets it by the meta the writer returned. The same two processes also move the same bytes
with raw Mooncake (``batch_put_from`` / ``batch_get_into`` between registered buffers, one object per
field, same master and store server: ``raw`` moves bytes only, ``raw_njt`` starts from and ends with
the nested tensors the API takes and returns), and, where available, through the TransferQueue adapter
(``tq://?backend=mooncake`` and ``tq://?backend=simple``). Every repetition runs every contender
once, in rotating order, so drift on a shared machine hits them alike; medians after warm-up.

    python -m benchmarks.mooncake_xproc                       # 16 MB and 128 MB, writes a dated report
    python -m benchmarks.mooncake_xproc --sizes 16 --repeat 5 --no-tq --out /tmp/x
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.harness import add_out_argument, bench_main, machine_info, machine_line, median_ci95, stats

MB = 1 << 20
TIMEOUT_S = 600.0
DECODE_THREAD_ENV = "DATAPLANE_DECODE_THREAD"  # documented in dataplane.adapters.mooncake


def _worker(
    role: str, conn: Connection, join_url: str, master: str, real_client: str | None, arena_bytes: int, n_fields: int
) -> None:
    import torch

    import dataplane
    from benchmarks.backends_mooncake import RawMooncake, field_buffers, field_specs
    from benchmarks.workload import in_client_memory, make_batch, same_fields

    try:
        client = dataplane.connect(join_url, timeout_s=TIMEOUT_S)
        raw = RawMooncake(master, arena_bytes, real_client)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    others: dict[str, Any] = {}
    batches: dict[int, Any] = {}
    in_memory: dict[int, Any] = {}  # the same batches built in client.empty memory (sent with no copy)
    njt_keys: dict[str, list[str]] = {}  # tag -> the objects of a raw_njt put (values and offsets)

    conn.send(("ready", os.getpid()))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "batch":
                    size, seed = args
                    batches[size] = make_batch(size * MB, n_fields, seed=seed)
                    in_memory[size] = in_client_memory(batches[size], client)
                    out: Any = batches[size].payload_bytes
                elif cmd == "put":
                    size, pid, url, zero_copy = args
                    c = client if url is None else others[url]
                    b = (in_memory if zero_copy else batches)[size]
                    t0 = time.perf_counter()
                    meta = c.kv_batch_put(b.keys, b.fields, partition_id=pid)
                    out = (time.perf_counter() - t0, meta)
                elif cmd == "get":
                    size, meta, url, verify = args
                    c = client if url is None else others[url]
                    t0 = time.perf_counter()
                    td = c.kv_batch_get(meta, select_fields=list(meta.fields))
                    dt = time.perf_counter() - t0
                    ok = not verify or same_fields(td, batches[size].fields)
                    del td
                    out = (dt, ok)
                elif cmd == "clear":
                    pid, url = args
                    (client if url is None else others[url]).kv_clear(partition_id=pid)
                    out = None
                elif cmd == "put_loop":  # n copy-free puts back to back: (wall s, metas)
                    size, tag, n = args
                    b = in_memory[size]
                    t0 = time.perf_counter()
                    metas = [client.kv_batch_put(b.keys, b.fields, partition_id=f"{tag}-{i}") for i in range(n)]
                    out = (time.perf_counter() - t0, metas)
                elif cmd == "get_loop":  # a get of each meta back to back: (wall s, the first read again is bit-exact)
                    size, metas, verify = args
                    t0 = time.perf_counter()
                    for meta in metas:
                        client.kv_batch_get(
                            meta, select_fields=list(meta.fields)
                        )  # dropped at once, as a trainer step would
                    dt = time.perf_counter() - t0
                    ok = not verify or same_fields(
                        client.kv_batch_get(metas[0], select_fields=list(metas[0].fields)), batches[size].fields
                    )
                    out = (dt, ok)
                elif cmd == "clear_loop":
                    tag, n = args
                    for i in range(n):
                        client.kv_clear(partition_id=f"{tag}-{i}")
                    out = None
                elif cmd in ("raw_put_loop", "raw_get_loop", "raw_clear_loop"):  # raw's twins of the above
                    size, tag, n, *verify_last = args
                    names = [name for name, _ in field_buffers(batches[size])]
                    keys_of = [[f"rawx/{tag}/{i}/{name}" for name in names] for i in range(n)]
                    if cmd == "raw_put_loop":
                        raw.load(field_buffers(batches[size]))
                        t0 = time.perf_counter()
                        for keys in keys_of:
                            raw.put(keys)
                        out = time.perf_counter() - t0
                    elif cmd == "raw_get_loop":
                        raw.sizes = [b.numel() for _, b in field_buffers(batches[size])]
                        t0 = time.perf_counter()
                        for keys in keys_of:
                            raw.get(keys)
                        dt = time.perf_counter() - t0
                        ok = True
                        if verify_last and verify_last[0]:  # what the last get left in the buffer
                            want = torch.cat([t for _, t in field_buffers(batches[size])]).numpy()
                            ok = bool((raw.read_back() == want).all())
                        out = (dt, ok)
                    else:
                        raw.remove([k for keys in keys_of for k in keys])
                        out = None
                elif cmd == "raw_njt_put":  # raw put of the batch as kv_batch_put takes it (raw_njt)
                    size, tag = args
                    b = batches[size]
                    fields = raw.stage_tensors(field_specs(b), field_buffers(b))
                    out, njt_keys[tag] = raw.put_tensors(f"rawx/{tag}/", fields)
                elif cmd == "raw_tensors":  # raw get, then the tensors a raw user needs (raw_njt)
                    size, tag, verify = args
                    b = batches[size]
                    sizes = [buf.numel() for _, buf in field_buffers(b)]
                    dt, got = raw.get_tensors(f"rawx/{tag}/", field_specs(b), sizes, len(b.keys))
                    ok = not verify or same_fields(got, b.fields)
                    del got
                    out = (dt, ok)
                elif cmd in ("raw_put", "raw_get"):
                    size, tag = args
                    keys = [f"rawx/{tag}/{name}" for name, _ in field_buffers(batches[size])]
                    if cmd == "raw_put":  # (put s, s to copy the batch into its registered buffer first)
                        t0 = time.perf_counter()
                        raw.load(field_buffers(batches[size]))
                        out = (raw.put(keys), time.perf_counter() - t0)
                    else:
                        raw.sizes = [b.numel() for _, b in field_buffers(batches[size])]
                        out = raw.get(keys)
                    if cmd == "raw_get" and tag.endswith("-verify"):
                        want_bytes = torch.cat([t for _, t in field_buffers(batches[size])]).numpy()
                        out = (out, bool((raw.read_back() == want_bytes).all()))
                elif cmd == "raw_clear":
                    size, tag = args
                    keys = njt_keys.pop(tag, None) or [f"rawx/{tag}/{n}" for n, _ in field_buffers(batches[size])]
                    raw.remove(keys)
                    out = None
                elif cmd == "connect":
                    url, env = args
                    os.environ.update(env)  # e.g. RAY_AUTH_MODE, set in the driver by ray.init after we started
                    if url not in others:
                        others[url] = dataplane.connect(url)
                    out = None
                elif cmd == "disconnect":
                    (url,) = args
                    c = others.pop(url, None)
                    if c is not None:
                        c.close()
                    out = None
                else:
                    raise ValueError(cmd)
                conn.send(("ok", out))
            except BaseException as e:  # report, keep serving
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        for c in others.values():
            c.close()
        raw.close()
        client.close()


class WorkerProcess:
    """A spawned process serving commands (``_worker``) over a pipe: one writer or reader.

    Start several with :meth:`start_all` and stop them with :meth:`stop_all`: they boot (and close)
    at the same time, not one after the other."""

    def __init__(self, ctx: Any, role: str, *args: Any, wait: bool = True) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(role, child, *args), daemon=True, name=f"xproc-{role}")
        self.proc.start()
        self.pid = self.ask_ready() if wait else 0

    @classmethod
    def start_all(cls, ctx: Any, roles: list[str], *args: Any) -> list[WorkerProcess]:
        """One process per role, all started before any is waited for; stopped again if one fails."""
        procs = [cls(ctx, role, *args, wait=False) for role in roles]
        try:
            for p in procs:
                p.pid = p.ask_ready()
        except BaseException:
            cls.stop_all(procs)
            raise
        return procs

    @staticmethod
    def stop_all(procs: list[WorkerProcess]) -> None:
        """Ask every process to stop, then wait for each."""
        for p in procs:
            p.ask_stop()
        for p in procs:
            p.stop()

    def ask_ready(self) -> int:
        if not self.conn.poll(180):
            raise TimeoutError("worker did not start within 180 s")
        kind, value = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"worker failed: {value}")
        return int(value)

    def call(self, *msg: Any) -> Any:
        self.send(*msg)
        return self.answer(msg[0])

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def answer(self, what: str) -> Any:
        """The worker's answer to the command ``what`` sent last."""
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"worker gave no answer to {what!r} within {TIMEOUT_S}s")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"{what} failed in worker: {value}")
        return value

    def ask_stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass

    def stop(self) -> None:
        self.ask_stop()  # a second stop is never read: the worker has left its loop
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)


def _tq_phases(enabled: bool) -> tuple[list[str | None], str]:
    """TransferQueue backends to measure (one per phase: TQ runs one deployment per Ray cluster)."""
    if not enabled:
        return [None], "TransferQueue skipped (--no-tq)"
    missing = [m for m in ("transfer_queue", "ray") if importlib.util.find_spec(m) is None]
    if missing:
        return [None], f"TransferQueue skipped: not installed ({', '.join(missing)})"
    return [None, "mooncake", "simple"], ""


def _rep(
    writer: WorkerProcess, reader: WorkerProcess, c: str, size: int, tag: str, verify: bool, tq_url: str | None
) -> tuple[float, float, bool, float | None]:
    """One put by the writer and one get by the reader: (put s, get s, bit-exact, raw's put plus
    copying the batch into its registered buffer first, or None)."""
    if c == "raw":
        tag += "-verify" if verify else ""
        tp, tp_copied = writer.call("raw_put", size, tag)
        res = reader.call("raw_get", size, tag)
        tg, ok = res if verify else (res, True)
        writer.call("raw_clear", size, tag)
        return tp, tg, ok, tp_copied
    if c == "raw_njt":
        tag += "-njt"
        tp = writer.call("raw_njt_put", size, tag)
        tg, ok = reader.call("raw_tensors", size, tag, verify)
        writer.call("raw_clear", size, tag)
        return tp, tg, ok, None
    url = None if c in ("ours", "ours_zc") else tq_url
    pid = f"x-{c}-{tag}"
    tp, meta = writer.call("put", size, pid, url, c == "ours_zc")
    tg, ok = reader.call("get", size, meta, url, verify)
    writer.call("clear", pid, url)
    return tp, tg, ok, None


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataplane
    from benchmarks.backends_mooncake import deployment_of

    machine = machine_info()
    arena = max(args.sizes) * MB * 2
    owner = dataplane.connect(
        f"mooncake://local?segment_bytes={args.segment_gib}GiB&shm={args.shm}", timeout_s=TIMEOUT_S
    )
    ctx = mp.get_context("spawn")
    join_url = owner.store.join_url  # type: ignore[attr-defined]
    dep = deployment_of(owner)
    procs: list[WorkerProcess] = []
    notes: list[str] = []
    times: dict[str, dict[int, dict[str, dict[str, list[float]]]]] = {}  # phase -> size -> contender
    verified: dict[int, dict[str, bool]] = {}
    payloads: dict[int, int] = {}
    try:
        procs = WorkerProcess.start_all(
            ctx, ["writer", "reader"], join_url, dep.master, dep.real_client, arena, args.fields
        )
        writer, reader = procs
        for size in args.sizes:
            payloads[size] = writer.call("batch", size, 0)
            reader.call("batch", size, 0)
        phases, note = _tq_phases(args.tq)
        if note:
            notes.append(note)
        for tq_backend in phases:
            tq_owner: Any = None
            tq_url: str | None = None
            name = f"tq_{tq_backend}" if tq_backend else None
            if tq_backend is not None:
                try:
                    tq_owner = dataplane.connect(
                        f"tq://?backend={tq_backend}&timeout_s={TIMEOUT_S}&segment_bytes={2 << 30}"
                    )
                    import ray

                    tq_url = f"tq://?ray_address={ray.get_runtime_context().gcs_address}&timeout_s={TIMEOUT_S}"
                    ray_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
                    writer.call("connect", tq_url, ray_env)
                    reader.call("connect", tq_url, ray_env)
                except Exception as e:  # measure what we can
                    notes.append(f"tq://?backend={tq_backend} unavailable: {type(e).__name__}: {e}")
                    if tq_owner is not None:
                        tq_owner.close()
                    continue
            try:
                contenders = ["ours", "ours_zc", "raw", "raw_njt"] + ([name] if name else [])
                for size in args.sizes:
                    t = times.setdefault(tq_backend or "no-tq", {}).setdefault(size, {})
                    for c in [*contenders, "raw_copied"]:
                        t.setdefault(c, {"put": [], "get": []})
                    for rep in range(args.warmup + args.repeat):
                        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
                        for c in order:
                            verify = rep == 0
                            tag = f"s{size}-{tq_backend}-r{rep}"
                            tp, tg, ok, tp_copied = _rep(writer, reader, c, size, tag, verify, tq_url)
                            if verify:
                                verified.setdefault(size, {})[c] = ok
                            if rep >= args.warmup:
                                t[c]["put"].append(tp)
                                t[c]["get"].append(tg)
                                if c == "raw" and tp_copied is not None:
                                    t["raw_copied"]["put"].append(tp_copied)
                                    t["raw_copied"]["get"].append(tg)
                        print(f"[{tq_backend}] {size} MB rep {rep + 1}", file=sys.stderr, flush=True)
            finally:
                if tq_url is not None:
                    writer.call("disconnect", tq_url)
                    reader.call("disconnect", tq_url)
                if tq_owner is not None:
                    tq_owner.close()
    finally:
        WorkerProcess.stop_all(procs)
        owner.close()
    results: dict[str, Any] = {}
    for phase, per_size in times.items():
        for size, t in per_size.items():
            payload = payloads[size]
            cell: dict[str, Any] = {"payload_bytes": payload}
            for c, v in t.items():
                if v["put"]:
                    put, get = stats(v["put"]), stats(v["get"])
                    cell[c] = {
                        "put": put,
                        "get": get,
                        "put_gbps": payload / put["median_s"] / 1e9,
                        "get_gbps": payload / get["median_s"] / 1e9,
                    }
            results.setdefault(f"{size}MB", {"bit_exact": verified.get(size, {})})[phase] = cell
    for cells in results.values():
        base = cells.get("no-tq", {})
        ratios: dict[str, float] = {}
        if "ours" in base and "raw" in base:
            for op in ("put", "get"):
                ratios[f"{op}_ours_vs_raw"] = base["ours"][f"{op}_gbps"] / base["raw"][f"{op}_gbps"]
            if "raw_copied" in base:
                ratios["put_ours_vs_raw_copied"] = base["ours"]["put_gbps"] / base["raw_copied"]["put_gbps"]
            if "ours_zc" in base:
                ratios["put_ours_zc_vs_raw"] = base["ours_zc"]["put_gbps"] / base["raw"]["put_gbps"]
            if "raw_njt" in base:
                ratios["get_ours_vs_raw_njt"] = base["ours"]["get_gbps"] / base["raw_njt"]["get_gbps"]
                ratios["get_raw_njt_vs_raw"] = base["raw_njt"]["get_gbps"] / base["raw"]["get_gbps"]
                ratios["put_raw_njt_vs_raw"] = base["raw_njt"]["put_gbps"] / base["raw"]["put_gbps"]
                if "ours_zc" in base:
                    ratios["put_ours_zc_vs_raw_njt"] = base["ours_zc"]["put_gbps"] / base["raw_njt"]["put_gbps"]
        # Paired: ours and raw run back to back in every repetition of every phase, so raw/ours per
        # repetition cancels the drift of a shared machine; the median over all of them.
        size_key = next(k for k, v in results.items() if v is cells)
        pairs: dict[str, list[float]] = {}
        for per_size in times.values():
            t = per_size.get(int(size_key[:-2]), {})
            for c in ("ours", "ours_zc"):
                if t.get(c, {}).get("put") and t.get("raw", {}).get("put"):
                    for op in ("put", "get"):
                        pairs.setdefault(f"{op}_{c}_vs_raw", [])
                        pairs[f"{op}_{c}_vs_raw"] += [r / o for o, r in zip(t[c][op], t["raw"][op], strict=True)]
                if t.get(c, {}).get("get") and t.get("raw_njt", {}).get("get"):
                    for op in ("put", "get"):
                        pairs.setdefault(f"{op}_{c}_vs_raw_njt", [])
                        pairs[f"{op}_{c}_vs_raw_njt"] += [
                            r / o for o, r in zip(t[c][op], t["raw_njt"][op], strict=True)
                        ]
        for name, xs in pairs.items():
            ratios[f"{name}_paired"] = statistics.median(xs)
            low, high = median_ci95(xs)
            cells.setdefault("paired_ci95", {})[name] = {"low": low, "high": high, "n": len(xs)}
        for phase, cell in cells.items():
            tq = f"tq_{phase}"
            if isinstance(cell, dict) and tq in cell:
                ratios[f"get_ours_vs_{tq}"] = cell["ours"]["get_gbps"] / cell[tq]["get_gbps"]
                ratios[f"put_ours_vs_{tq}"] = cell["ours"]["put_gbps"] / cell[tq]["put_gbps"]
        cells["ratios"] = ratios
    return {
        "schema_version": 1,
        "benchmark": "mooncake_xproc" if args.shm else "mooncake_xproc_tcp",
        "created_unix": time.time(),
        "config": {
            "sizes_mb": args.sizes,
            "fields": args.fields,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "segment_gib": args.segment_gib,
            "transport": "shared memory (real client)" if args.shm else "loopback TCP",
            "rows": "64 below 8 MB, else 256 (make_batch)",
            "phases": [p or "no-tq" for p in phases],
            "decode_thread_env": os.environ.get(DECODE_THREAD_ENV),  # unset: the adapter's default
        },
        "machine": {**machine, "loadavg_after": os.getloadavg()},
        "targets": {"put_ours_zc_vs_raw": ">= 0.9", "get_ours_vs_raw": ">= 0.9", "get_ours_vs_tq": ">= 1.5"},
        "notes": notes,
        "results": results,
    }


def to_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# mooncake:// between processes: ours vs raw Mooncake vs TransferQueue",
        "",
        machine_line(m),
        f"Batches: `make_batch(size, {report['config']['fields']} fields)` (jagged token fields + a [B] reward); "
        f"writer and reader are separate spawned processes, the store server a third; medians of "
        f"{report['config']['repeat']} after {report['config']['warmup']} warm-up, contenders interleaved. "
        f"Transport: {report['config']['transport']}. `$DATAPLANE_DECODE_THREAD`: "
        f"{report['config'].get('decode_thread_env') or 'unset (the default)'}.",
        "",
        "`raw` puts from a registered buffer the batch already sits in; `raw_copied` also copies the batch "
        "into it first (timed), as a raw user holding tensors must when only registered memory can be sent. "
        "`ours` puts the batch from ordinary tensors (the adapter copies them into its shared memory); "
        "`ours_zc` puts the same batch built in `client.empty()` memory, like raw's (sent with no copy). "
        "Both read it back the same way. `raw_njt` is raw Mooncake used on what the API takes and returns: "
        "its put starts from the batch as `kv_batch_put` takes it (nested tensors whose values already lie "
        "in registered memory, like ours_zc's) and writes each field's values and each distinct offsets "
        "tensor (copied into registered memory) with one `batch_put_from`; its get reads them back with one "
        "`batch_get_into` and makes the tensors `kv_batch_get` returns: each field viewed as its dtype, each "
        "jagged one a nested tensor from torch's `nested_tensor_from_jagged` over the offsets it read. It "
        "knows the schema and row count without asking (a raw user's code would), and keeps no index, "
        "schema check or validation.",
        "",
        "`*_ours_vs_raw` compare medians from the phase without TransferQueue (no Ray running); "
        "`*_vs_raw_paired` (`*_vs_raw_njt_paired`) is the median, over every repetition of every phase, of "
        "raw/ours (raw_njt/ours) timed back to back in that repetition (the drift of a shared 2-core machine "
        "cancels). Each TQ ratio compares with "
        "ours measured in that TQ's phase (Ray and its actors running, so every figure there is slower).",
        "",
        "| size | phase | contender | put ms | get ms | put GB/s | get GB/s | bit-exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size, cells in report["results"].items():
        for phase, cell in cells.items():
            if phase in ("bit_exact", "ratios", "paired_ci95"):
                continue
            for c, v in cell.items():
                if not isinstance(v, dict):
                    continue
                lines.append(
                    f"| {size} | {phase} | {c} | {v['put']['median_s'] * 1e3:.1f} | {v['get']['median_s'] * 1e3:.1f} | "
                    f"{v['put_gbps']:.2f} | {v['get_gbps']:.2f} | {cells['bit_exact'].get(c, '-')} |"
                )
    lines += ["", "| size | ratio | value |", "| --- | --- | --- |"]
    for size, cells in report["results"].items():
        for k, v in cells["ratios"].items():
            lines.append(f"| {size} | {k} | **{v:.2f}** |")
    lines += [""]
    for size, cells in report["results"].items():
        ci = cells.get("paired_ci95", {})
        if ci:
            lines.append(
                f"- {size}: 95% confidence interval of the paired median (baseline/ours, distribution-free): "
                + ", ".join(f"{op} {v['low']:.2f}–{v['high']:.2f} (n={v['n']})" for op, v in ci.items())
                + "."
            )
    lines += ["", "Targets: " + ", ".join(f"{k} {v}" for k, v in report["targets"].items()) + "."]
    lines += [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mooncake_xproc", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128])
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--segment-gib", type=int, default=3)
    p.add_argument("--no-tq", dest="tq", action="store_false")
    p.add_argument(
        "--tcp", dest="shm", action="store_false", help="mooncake://local?shm=false: clients reach the store over TCP"
    )
    add_out_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
