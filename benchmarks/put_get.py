"""``python -m benchmarks.put_get``: put/get throughput of every installed backend beside its ceilings.

Every figure is measured in the same run as the ceilings it is compared with (memcpy into a
preallocated buffer, just before each row; the backend's raw API where one is wired in), so the
ratios survive a noisy machine. Medians of ``--repeat`` timed runs after one warm-up, with min, max
and spread; figures whose repeats disagree or that beat memcpy are flagged noisy, not reported.
A put is compared like with like: from ordinary tensors against raw with the same copy into the
memory it sends from, and (where the backend has one) from ``client.empty()`` memory against raw
from registered memory.

Writes the report (JSON, markdown, PNG plot) to ``./put_get-<date>-<time>_<machine>.*`` unless
told otherwise, and prints where:

    python -m benchmarks.put_get                      # every installed backend, default grid
    python -m benchmarks.put_get --quick              # smoke run (what CI runs)
    python -m benchmarks.put_get --backend memory --sizes 128 --fields 1,32 --out /tmp/mine
    python -m benchmarks.put_get --report             # the dated report in benchmarks/reports/
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import dataplane
from benchmarks.backends import BenchBackend, RawTimes, all_backends
from benchmarks.harness import default_out, machine_info, machine_label, median, paired
from benchmarks.put_get_report import format_table, noisy_figures, noisy_summary, plot, spread, to_markdown
from benchmarks.readers import ReaderPool
from benchmarks.workload import Batch, flat_views, in_client_memory, make_batch

SCHEMA_VERSION = 2
MEMCPY_REPEAT = 7  # at least this many memcpy timings per row (they are cheap): the ceiling is the fastest
MB = 1 << 20
CLOSE_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0  # bound on waiting for a backend started early (connect has its own bounds too)


@dataclass
class Timing:
    median_s: float
    min_s: float
    max_s: float
    n: int
    spread: float  # see benchmarks.put_get_report.spread
    samples_s: list[float]  # every repetition, in the order timed

    @classmethod
    def of(cls, xs: list[float]) -> Timing:
        return cls(median_s=median(xs), min_s=min(xs), max_s=max(xs), n=len(xs), spread=spread(xs), samples_s=list(xs))


@dataclass
class CaseResult:
    """One row: a backend's put from ``put_from`` (see ``benchmarks.backends.PUT_FROM``) and the
    get of what it put, beside memcpy and the backend's raw API starting from the same place."""

    backend: str
    put_from: str
    size_mb: int
    n_fields: int
    layout: str
    readers: int
    payload_bytes: int
    padded_bytes: int
    put: Timing
    get: Timing
    put_gbps: float
    get_gbps: float
    memcpy: Timing
    memcpy_gbps: float  # the fastest memcpy: the ceiling
    put_vs_memcpy: float
    get_vs_memcpy: float
    raw_put: Timing | None = None
    raw_get: Timing | None = None
    raw_put_gbps: float | None = None
    raw_get_gbps: float | None = None
    put_vs_raw: float | None = None  # paired median: raw's seconds over ours, repetition by repetition
    get_vs_raw: float | None = None
    put_vs_raw_ci95: list[float] | None = None  # [low, high]: distribution-free 95% interval of that median
    get_vs_raw_ci95: list[float] | None = None
    noisy: dict[str, str] = field(default_factory=dict)  # figure -> why it is not a result
    extra: dict[str, Any] = field(default_factory=dict)


def _backends() -> list[BenchBackend]:
    return all_backends()


def memcpy_seconds(batch: Batch, repeat: int) -> list[float]:
    """Copy the batch's bytes into one preallocated buffer: the ceiling of any in-host data path.
    Each repetition copies twice, with torch's threads and with one thread, and keeps the faster
    (on a busy machine a multi-threaded copy waits for its slowest thread; on a big one it beats
    one thread)."""
    views = flat_views(batch)
    dst = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8)
    threads = torch.get_num_threads()
    times = []
    try:
        for i in range(repeat + 1):
            best = math.inf
            for n in {threads, 1}:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                at = 0
                for v in views:
                    dst[at : at + v.numel()].copy_(v)
                    at += v.numel()
                best = min(best, time.perf_counter() - t0)
            if i:
                times.append(best)
    finally:
        torch.set_num_threads(threads)
    return times


def run_case(
    client: dataplane.DataPlaneClient,
    batches: dict[str, Batch],
    repeat: int,
    readers: ReaderPool | None = None,
    warmup: int = 1,
) -> dict[str, tuple[list[float], list[float]]]:
    """Put each batch (one per put path: the same data, in different memory), then get it by the
    meta the put returned (as an RL job ships it): in this process, or in every reader process at
    once (wall time until the last one has it). The paths take turns in every repetition, so a
    drift of the machine hits them alike. Per path: (put seconds, get seconds)."""
    out: dict[str, tuple[list[float], list[float]]] = {path: ([], []) for path in batches}
    for i in range(warmup + repeat):
        for path, batch in batches.items():
            names = list(batch.fields)
            pid = f"bench-{os.getpid()}-{path}-{i}"
            t0 = time.perf_counter()
            meta = client.kv_batch_put(batch.keys, batch.fields, partition_id=pid)
            t1 = time.perf_counter()
            if readers is None:
                got = client.kv_batch_get(meta, select_fields=names, layout="jagged")
                t2 = time.perf_counter()
                if got.batch_size[0] != len(batch.keys):
                    raise RuntimeError("benchmark get returned the wrong number of rows")
                del got
                get_s = t2 - t1
            else:
                get_s, _ = readers.get_all(meta, names)
            client.kv_clear(partition_id=pid)
            if i >= warmup:
                out[path][0].append(t1 - t0)
                out[path][1].append(get_s)
    return out


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        self.total, self.done, self.enabled = total, 0, enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="case", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _grid(args: argparse.Namespace) -> Iterator[tuple[int, int, str]]:
    for size in args.sizes:
        for n_fields in args.fields:
            for layout in args.layouts:
                yield size, n_fields, layout


def ray_seconds(batch: Batch, repeat: int) -> tuple[list[float], list[float]] | None:
    """Raw ``ray.put``/``ray.get`` of the batch's tensors in this process, or None without Ray."""
    try:
        import ray
    except ImportError:
        return None
    _init_ray()
    tensors = {k: (v.values() if v.is_nested else v) for k, v in batch.fields.items() if isinstance(v, torch.Tensor)}
    puts, gets = [], []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        ref = ray.put(tensors)
        t1 = time.perf_counter()
        out = ray.get(ref, timeout=300)
        t2 = time.perf_counter()
        del out, ref
        if i:
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    return puts, gets


@dataclass
class RayCeilings:
    put_gbps: float | None
    get_gbps: float | None


def _ray_ceilings(batch: Batch, repeat: int, with_ray: bool) -> RayCeilings:
    ray_t = ray_seconds(batch, repeat) if with_ray else None
    if ray_t is None:
        return RayCeilings(None, None)
    return RayCeilings(batch.payload_bytes / median(ray_t[0]) / 1e9, batch.payload_bytes / median(ray_t[1]) / 1e9)


def _measure(
    backend: BenchBackend,
    client: dataplane.DataPlaneClient,
    batch: Batch,
    case: tuple[int, int, str],
    ray_ceilings: RayCeilings,
    args: argparse.Namespace,
    readers: ReaderPool | None,
) -> list[CaseResult]:
    """One row per put path of the backend: memcpy just before, then ours and the raw API in turns,
    one repetition each (raw first every other time), so a drift of the machine hits both alike and
    ours/raw is a paired median."""
    size, n_fields, layout = case
    memcpy = Timing.of(memcpy_seconds(batch, max(args.repeat, MEMCPY_REPEAT)))
    memcpy_gbps = batch.payload_bytes / memcpy.min_s / 1e9
    batches = {path: batch if path == "tensors" else in_client_memory(batch, client) for path in backend.put_from}
    raw_fn = backend.raw if readers is None else None
    ours = run_case(client, batches, 0, readers)  # the warm-ups
    raw = raw_fn(batch, 0, client, 1) if raw_fn is not None else None
    for rep in range(args.repeat):
        if raw is not None and raw_fn is not None and rep % 2:
            _extend(raw, raw_fn(batch, 1, client, 0))
        for path, (puts, gets) in run_case(client, batches, 1, readers, warmup=0).items():
            ours[path][0].extend(puts)
            ours[path][1].extend(gets)
        if raw is not None and raw_fn is not None and not rep % 2:
            _extend(raw, raw_fn(batch, 1, client, 0))
    del batches
    n_readers = 0 if readers is None else len(readers.procs)
    got_bytes = batch.payload_bytes * max(1, n_readers)  # aggregate over readers
    out = []
    for path, (puts, gets) in ours.items():
        put_gbps = batch.payload_bytes / median(puts) / 1e9
        get_gbps = got_bytes / median(gets) / 1e9
        res = CaseResult(
            backend=backend.name, put_from=path, size_mb=size, n_fields=n_fields, layout=layout, readers=n_readers,
            payload_bytes=batch.payload_bytes, padded_bytes=batch.padded_bytes,
            put=Timing.of(puts), get=Timing.of(gets), put_gbps=put_gbps, get_gbps=get_gbps,
            memcpy=memcpy, memcpy_gbps=memcpy_gbps, put_vs_memcpy=put_gbps / memcpy_gbps,
            get_vs_memcpy=get_gbps / memcpy_gbps,
        )  # fmt: skip
        res.extra["ray_put_gbps"] = ray_ceilings.put_gbps
        res.extra["ray_get_gbps"] = ray_ceilings.get_gbps
        if raw is not None and path in raw.put:
            res.raw_put, res.raw_get = Timing.of(raw.put[path]), Timing.of(raw.get)
            res.raw_put_gbps = batch.payload_bytes / res.raw_put.median_s / 1e9
            res.raw_get_gbps = batch.payload_bytes / res.raw_get.median_s / 1e9
            put_paired, get_paired = paired(raw.put[path], puts), paired(raw.get, gets)
            res.put_vs_raw, res.get_vs_raw = put_paired["median"], get_paired["median"]
            res.put_vs_raw_ci95 = [put_paired["low"], put_paired["high"]]
            res.get_vs_raw_ci95 = [get_paired["low"], get_paired["high"]]
        out.append(res)
    return out


def _extend(into: RawTimes, more: RawTimes) -> None:
    into.get.extend(more.get)
    for path, xs in more.put.items():
        into.put.setdefault(path, []).extend(xs)


def _start_early(installed: list[BenchBackend], args: argparse.Namespace) -> dict[str, Future[Any]]:
    """Start what boots slowly but mostly waits, on threads, while Ray starts on the main thread
    (for its ceiling; it installs signal handlers): the first backend that needs no Ray, and every
    backend's ``prepare``. Nothing is measured until this returns. With ``--quick`` (a smoke run,
    whose figures are not for comparing) the first TransferQueue backend also starts here, once Ray
    is up, and goes on booting while the backends before it are measured.

    Returns futures of clients (key: backend name) and of prepared options (key: ``prep:NAME``).
    """
    jobs: dict[str, Future[Any]] = {}
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bench-start")
    for b in installed:
        if b.prepare is not None:
            jobs[f"prep:{b.name}"] = pool.submit(b.prepare)
    # not tq://: TransferQueue joins (or starts) Ray itself, which must not race our ray.init
    first = next((b for b in installed if not b.url.startswith(("memory:", "tq:"))), None)
    if first is not None:
        jobs[first.name] = pool.submit(dataplane.connect, first.url, **first.options)
    if args.ray and importlib.util.find_spec("ray") is not None:
        _init_ray()
        tq = next((b for b in installed if b.url.startswith("tq:") and b.prepare is None), None)
        if args.quick and tq is not None:  # a smoke run: its first TransferQueue starts during measurements
            jobs[tq.name] = pool.submit(dataplane.connect, tq.url, **tq.options)
    pool.shutdown(wait=False)
    return jobs


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _init_ray() -> None:
    import ray

    if not ray.is_initialized():
        from dataplane.observability import backend_logs

        quiet = not backend_logs()  # no token-auth warning, no start-up banner
        ray.init(
            num_cpus=max(4, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR if quiet else logging.INFO,
        )


class _Closer:
    """Closes clients on threads: a teardown mostly waits (Mooncake's close sleeps ~1 s, stopping
    TransferQueue's actors takes seconds), so the next backend starts meanwhile. Backends of one URL
    scheme wait for each other (a process runs one TransferQueue at a time)."""

    def __init__(self) -> None:
        self._pending: dict[str, list[threading.Thread]] = {}

    def start(
        self,
        scheme: str,
        client: dataplane.DataPlaneClient,
        before: Callable[[], None] | None,
        after: Callable[[], None] | None,
    ) -> None:
        def close() -> None:
            try:
                if before is not None:
                    before()
            finally:
                client.close()
                if after is not None:
                    after()

        t = threading.Thread(target=close, name=f"close-{scheme}", daemon=True)
        t.start()
        self._pending.setdefault(scheme, []).append(t)

    def wait_for(self, scheme: str) -> None:
        for t in self._pending.pop(scheme, []):
            t.join(CLOSE_TIMEOUT_S)

    def wait_all(self) -> None:
        for scheme in list(self._pending):
            self.wait_for(scheme)


def run(args: argparse.Namespace) -> dict[str, Any]:
    chosen = [b for b in _backends() if args.backend in (None, "all") or b.name in args.backend]
    installed, skipped = [], {}
    for b in chosen:
        missing = b.missing()
        if missing:
            skipped[b.name] = f"not installed: {', '.join(missing)}"
        else:
            installed.append(b)
    cases = list(_grid(args))
    progress = _Progress(len(cases) * len(installed), enabled=not args.no_progress)
    machine = machine_info()
    results: list[CaseResult] = []
    ceilings: dict[tuple[int, int, str], RayCeilings] = {}
    notes: dict[str, str] = {}
    if args.quick:
        notes["quick"] = "smoke run: the first TransferQueue backend starts while the backends before it are measured"
    closing = _Closer()
    ray_was_up = _ray_is_up()
    early = _start_early(installed, args)
    if not args.quick:  # nothing starts while anything is measured (a smoke run does not care)
        futures.wait(list(early.values()), timeout=START_TIMEOUT_S)
    try:
        for backend in installed:
            closing.wait_for(backend.url.split(":", 1)[0])  # one TransferQueue per process at a time
            cleanup: Callable[[], None] | None = None
            try:
                options = dict(backend.options)
                prepared = early.pop(f"prep:{backend.name}", None)
                if prepared is not None:
                    extra, cleanup = prepared.result(timeout=START_TIMEOUT_S)
                    options.update(extra)
                pending = early.pop(backend.name, None)
                client = (
                    pending.result(timeout=START_TIMEOUT_S)
                    if pending is not None
                    else dataplane.connect(backend.url, **options)
                )
            except Exception as e:  # report and go on with the other backends
                skipped[backend.name] = f"failed to start: {type(e).__name__}: {e}"
                if cleanup is not None:
                    cleanup()
                continue
            finally:
                closing.wait_all()  # teardowns overlap start-ups, never measurements
            readers = None
            try:
                if args.readers:
                    if backend.reader_url is None:
                        notes[backend.name] = "in-process store: measured with the writer's process reading"
                    else:
                        url, options = backend.reader_url(client)
                        readers = ReaderPool(args.readers, url, options)
                for case in cases:
                    size, n_fields, layout = case
                    batch = make_batch(size * MB, n_fields, layout=layout, objects=args.objects)  # type: ignore[arg-type]
                    if case not in ceilings:
                        ceilings[case] = _ray_ceilings(batch, args.repeat, with_ray=args.ray)
                    results += _measure(backend, client, batch, case, ceilings[case], args, readers)
                    del batch
                    gc.collect()
                    progress.step(f"{backend.name} {size}MB x{n_fields} {layout}")
            except Exception as e:  # one backend failing mid-run must not lose the others' results
                skipped[backend.name] = f"failed during the run: {type(e).__name__}: {e}"
            finally:
                if readers is not None:
                    readers.close()
                closing.start(backend.url.split(":", 1)[0], client, backend.before_close, cleanup)
    finally:  # a run cut short still stops what was started early for backends it never reached
        for name, job in early.items():
            with contextlib.suppress(Exception):
                got = job.result(timeout=START_TIMEOUT_S)
                if name.startswith("prep:"):
                    got[1]()
                else:
                    got.close()
    closing.wait_all()
    if not ray_was_up and _ray_is_up():  # ours: stop it now (left to exit, its teardown takes seconds longer)
        import ray

        ray.shutdown()
    progress.close()
    if hasattr(os, "getloadavg"):
        machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    rows = [asdict(r) for r in results]
    for row in rows:
        row["noisy"] = noisy_figures(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "put_get",
        "date": datetime.date.today().isoformat(),
        "created_unix": time.time(),
        "command": args.command,
        "machine": machine,
        "config": {
            "sizes_mb": args.sizes,
            "fields": args.fields,
            "layouts": args.layouts,
            "repeat": args.repeat,
            "readers": args.readers,
        },
        "backends": {b.name: skipped.get(b.name, "ok") for b in chosen},
        "paths": {b.name: b.paths for b in installed},
        "notes": notes,
        "results": rows,
    }


def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.put_get", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend", type=lambda s: s.split(","), default=None, help="comma list of backends (default: all installed)"
    )
    p.add_argument("--sizes", type=_csv_ints, default=None, help="payload sizes in MB (default 1,16,128)")
    p.add_argument("--fields", type=_csv_ints, default=None, help="field counts (default 1,8,32)")
    p.add_argument(
        "--layouts", type=lambda s: s.split(","), default=None, help="wire layouts: jagged,padded (default jagged)"
    )
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions after one warm-up (default 5)")
    p.add_argument("--objects", action="store_true", help="add an object column (chat messages) to every batch")
    p.add_argument(
        "--readers", type=int, default=0, help="N reader processes get each batch at once (default 0: the writer reads)"
    )
    p.add_argument("--no-ray", dest="ray", action="store_false", help="skip the raw ray.put/ray.get ceiling")
    p.add_argument("--quick", action="store_true", help="small grid, few repeats (the CI smoke run)")
    out = p.add_argument_group("output (default: ./put_get-<date>-<time>_<machine>.json, .md and .png)")
    out.add_argument("--out", metavar="STEM", help="write STEM.json, STEM.md and STEM.png instead")
    out.add_argument(
        "--report",
        action="store_true",
        help="write the dated report benchmarks/reports/<date>_<machine>_put_get.* (then add it to the index)",
    )
    out.add_argument("--json", metavar="PATH", help="write the JSON here (with --plot: only these files)")
    out.add_argument("--plot", metavar="PATH", help="write the PNG plot here (needs matplotlib)")
    out.add_argument("--no-output", action="store_true", help="write no file, print the table only")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.command = " ".join(["python -m benchmarks.put_get", *(sys.argv[1:] if argv is None else argv)])
    quick = args.quick
    args.sizes = args.sizes or ([4] if quick else [1, 16, 128])
    args.fields = args.fields or ([1, 8] if quick else [1, 8, 32])
    args.layouts = args.layouts or ["jagged"]
    args.repeat = args.repeat or (2 if quick else 5)
    return args


def output_paths(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Path]:
    """Where the report goes: ``json``, ``md`` and ``png`` (see ``--help``); empty with --no-output."""
    if args.no_output:
        return {}
    if args.json or args.plot:  # only the files asked for
        return {k: Path(v) for k, v in (("json", args.json), ("png", args.plot)) if v}
    if args.out:
        stem = Path(args.out)
    elif args.report:
        stem = default_out("put_get", machine)
    else:
        stem = Path(f"put_get-{datetime.datetime.now():%Y-%m-%d-%H%M}_{machine_label(machine)}")
    return {ext: stem.with_name(stem.name + f".{ext}") for ext in ("json", "md", "png")}


def write_outputs(report: dict[str, Any], paths: dict[str, Path]) -> list[str]:
    """Write the report's files; what was written, for the closing lines."""
    done = []
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    if "png" in paths:
        try:
            plot(report, str(paths["png"]))
            done.append(str(paths["png"]))
        except ImportError:
            print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
            del paths["png"]
    if "md" in paths:
        paths["md"].write_text(to_markdown(report, paths["png"].name if "png" in paths else None))
        done.append(str(paths["md"]))
    if "json" in paths:
        paths["json"].write_text(json.dumps(report, indent=1) + "\n")
        done.append(str(paths["json"]))
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(format_table(report, notes=False))  # each noisy figure's value and why: in the files only
    paths = output_paths(args, report["machine"])
    written = write_outputs(report, paths)
    kept = [str(paths[ext]) for ext in ("md", "json") if ext in paths]
    summary = noisy_summary(report, " and ".join(kept) if kept else "rerun without --no-output to keep them")
    if summary:
        print(summary)
    if written:
        print(f"wrote {', '.join(written)}")
        print("(--out STEM to write elsewhere, --no-output for no files; --help lists every option)")
    else:
        print("wrote no files (--no-output); --help lists every option")
    return 0


if __name__ == "__main__":
    sys.exit(main())
