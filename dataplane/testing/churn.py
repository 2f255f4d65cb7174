"""Churn one deployment from several processes: writers rewrite and clear the same keys while readers
get them, each in a process of its own, and every row a reader gets must be exactly one that some
writer wrote.

Rows describe themselves: row ``i`` of put number ``version`` is ``version * 1000 + i`` repeated
over a length that ``(version, i)`` fixes, in a jagged field ``x``, a dense field ``y`` and an
object field ``m``. Writer ``w`` numbers its puts ``w, w + 10, w + 20, ...``, so a reader can tell a
whole row from a torn one (values of two puts), another key's row, or another field's bytes.

A reader may see ``KeyNotFound`` for rows cleared under it, and nothing else: any other error is
reported (by type and message) and fails :func:`run_churn`'s caller::

    report = run_churn(url, seconds=3.0)
    assert report.ok, report.problems

Every process joins with ``dataplane.connect(url)``; the functions here are the processes' targets
(importable, so ``forkserver`` and ``spawn`` children find them). Each process's stderr (file
descriptor 2, so native libraries' logs too) goes to a file; its lines at WARNING or above come back
in :attr:`ChurnReport.noise`: a race the adapter handles must not print one.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

import dataplane
from dataplane.errors import CapacityExceeded, KeyNotFound
from dataplane.testing.logs import noisy_lines

__all__ = ["KEYS", "PARTITION", "ChurnReport", "clearer", "reader", "row", "row_len", "run_churn", "writer"]

KEYS = [f"k{i}" for i in range(32)]
PARTITION = "churn"
MIN_OPS = 10  # puts of each writer, gets of each reader, however long they take on a loaded host


def row_len(version: int, i: int, scale: int) -> int:
    """Length of row ``i`` as put number ``version`` writes it (``scale`` stretches every row)."""
    return ((version * 7 + i) % 13 + 1) * scale


def row(version: int, i: int, scale: int) -> torch.Tensor:
    """Row ``i`` of jagged field ``x`` as put number ``version`` writes it: its length and every
    value say which put."""
    return torch.full((row_len(version, i, scale),), version * 1000 + i, dtype=torch.int64)


def _ready(conn: Connection) -> bool:
    """Tell the parent this process has joined, and wait for everyone's start (False: stop now)."""
    conn.send("ready")
    return bool(conn.recv())


def writer(
    url: str, first: int, seconds: float, scale: int, clears: bool, env: dict[str, str], conn: Connection
) -> None:
    """Put every key once (before the churn starts), then rewrite random subsets of the keys (``x``, often ``y`` and ``m`` too) until ``seconds`` pass;
    with ``clears``, clear a few keys, now and then the whole partition, after some puts. A full
    store pushes back with ``CapacityExceeded``: the writer waits a little and goes on, as a rollout
    worker would. Sends ``(puts, clears, error)``."""
    rng, puts, cleared, full, version, error = random.Random(first), 0, 0, 0, first, None

    def fields_of(version: int, ids: list[int], every: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "x": torch.nested.as_nested_tensor([row(version, i, scale) for i in ids], layout=torch.jagged)
        }
        if every:
            out["y"] = torch.tensor([version * 1000 + i for i in ids])
            out["m"] = [{"v": version, "i": i} for i in ids]
        return out

    try:
        os.environ.update(env)
        with dataplane.connect(url, timeout_s=60) as c:
            ids = [int(k[1:]) for k in KEYS]
            c.kv_batch_put(KEYS, fields_of(version, ids, True), partition_id=PARTITION)  # every key, to start
            if not _ready(conn):
                return
            end = time.monotonic() + seconds
            while time.monotonic() < end or puts < MIN_OPS:
                version += 10
                keys = rng.sample(KEYS, rng.randint(1, len(KEYS)))
                ids = [int(k[1:]) for k in keys]
                try:
                    c.kv_batch_put(keys, fields_of(version, ids, rng.random() < 0.7), partition_id=PARTITION)
                    puts += 1
                except CapacityExceeded:
                    full += 1
                    time.sleep(0.05)
                if clears and rng.random() < 0.2:
                    if rng.random() < 0.05:
                        c.kv_clear(partition_id=PARTITION)
                    else:
                        c.kv_clear(rng.sample(KEYS, 2), partition_id=PARTITION)
                    cleared += 1
    except BaseException as e:  # reported to the parent, which fails the test
        error = _describe(e)
    if puts == 0 and full and error is None:
        error = f"every put of {full} raised CapacityExceeded"
    conn.send((puts, cleared, error))


def clearer(url: str, seconds: float, env: dict[str, str], conn: Connection) -> None:
    """Clear some keys, or the whole partition, every few milliseconds. Sends ``(clears, error)``."""
    rng, n, error = random.Random(7), 0, None
    try:
        os.environ.update(env)
        with dataplane.connect(url, timeout_s=60) as c:
            if not _ready(conn):
                return
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(0.02)
                if rng.random() < 0.2:
                    c.kv_clear(partition_id=PARTITION)
                else:
                    c.kv_clear(rng.sample(KEYS, 4), partition_id=PARTITION)
                n += 1
    except BaseException as e:
        error = _describe(e)
    conn.send((n, error))


def _bad_row(key: str, x: torch.Tensor, y: int | None, m: Any, scale: int) -> str | None:
    """Why the row read for ``key`` is not one a writer wrote (None: it is)."""
    i, value = int(key[1:]), int(x[0]) if len(x) else -1
    version = value // 1000
    whole = value % 1000 == i and bool((x == value).all()) and len(x) == row_len(version, i, scale)
    if not whole:
        return f"{key}: x={x.tolist()[:8]}... (len {len(x)}) is no row a put wrote"
    if y is not None and y % 1000 != i:
        return f"{key}: y={y} belongs to another key"
    if m is not None and (not isinstance(m, dict) or m.get("i") != i):
        return f"{key}: m={m!r} belongs to another key"
    return None


def reader(url: str, seed: int, seconds: float, scale: int, env: dict[str, str], conn: Connection) -> None:
    """Get random keys, by keys, until ``seconds`` pass (and :data:`MIN_OPS` gets were tried); check
    every row. Sends ``(gets, rows, missing, problem)``: gets that returned, rows checked, gets that
    raised ``KeyNotFound``, and the first bad row or other error (None when there was none)."""
    rng, gets, rows, missing, problem, last_missing = random.Random(seed), 0, 0, 0, None, ""
    try:
        os.environ.update(env)
        with dataplane.connect(url, timeout_s=60) as c:
            if not _ready(conn):
                return
            end = time.monotonic() + seconds
            while (time.monotonic() < end or gets + missing < MIN_OPS) and problem is None:
                keys = rng.sample(KEYS, rng.randint(1, 4))
                select = ["x", "y", "m"] if rng.random() < 0.3 else ["x"]
                try:
                    out = c.kv_batch_get(keys, partition_id=PARTITION, select_fields=select)
                except KeyNotFound as e:
                    missing += 1
                    last_missing = str(e)
                    continue
                gets += 1
                xs = out["x"].unbind()
                ys = out["y"].tolist() if "y" in select else [None] * len(keys)
                ms = out["m"] if "m" in select else [None] * len(keys)
                for key, x, y, m in zip(keys, xs, ys, ms, strict=True):
                    problem = problem or _bad_row(key, x, y, m, scale)
                    rows += 1
    except BaseException as e:
        problem = _describe(e)
    conn.send((gets, rows, missing, problem, last_missing))


def _with_stderr_to(path: str, target: Callable[..., None], *args: Any) -> None:
    """Run ``target(*args)`` with this process's file descriptor 2 (native libraries' logs
    included) written to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    target(*args)


def _describe(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" (at {where.filename}:{where.lineno})" if where else ""
    return f"{type(e).__module__}.{type(e).__qualname__}: {e}{at}"


@dataclass
class ChurnReport:
    """What the processes of one :func:`run_churn` did."""

    writers: list[tuple[int, int]] = field(default_factory=list)  # (puts, clears) per writer
    clears: int = 0  # by the clearer, if any
    readers: list[tuple[int, int, int]] = field(default_factory=list)  # (gets, rows, KeyNotFound) per reader
    problems: list[str] = field(default_factory=list)  # bad rows and errors other than KeyNotFound
    noise: list[str] = field(default_factory=list)  # stderr lines at WARNING or above, by process
    last_missing: str = ""  # the message of a reader's last KeyNotFound

    @property
    def ok(self) -> bool:
        """No problem, and every process made progress."""
        progress = all(p for p, _ in self.writers) and all(g and r for g, r, _ in self.readers)
        return not self.problems and progress

    def summary(self) -> str:
        puts = sum(p for p, _ in self.writers)
        clears = self.clears + sum(c for _, c in self.writers)
        gets = sum(g for g, _, _ in self.readers)
        missing = sum(m for _, _, m in self.readers)
        return f"{puts} puts, {clears} clears, {gets} gets ({missing} raised KeyNotFound)"


def run_churn(
    url: str,
    *,
    seconds: float,
    scale: int = 1,
    writers: int = 2,
    readers: int = 2,
    clearer_process: bool = False,
    writers_clear: bool = True,
    context: str = "forkserver",
    join_timeout_s: float = 180.0,
) -> ChurnReport:
    """Churn the deployment at ``url`` for ``seconds`` from ``writers`` + ``readers`` processes (and
    a clearer, with ``clearer_process``) of the ``multiprocessing`` start method ``context``.

    Every process first joins the deployment; the churn starts once all have, so it overlaps
    whatever joining costs (seconds on Ray). A process that has not joined within
    ``join_timeout_s`` fails the run."""
    ctx: Any = mp.get_context(context)
    # this process's environment as it is now: a forkserver started earlier has an older one, and
    # joining may need what was set since (a Ray this process started sets its session's variables)
    env = dict(os.environ)
    jobs: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (writer, (url, w, seconds, scale, writers_clear, env)) for w in range(writers)
    ]
    if clearer_process:
        jobs.append((clearer, (url, seconds, env)))
    jobs += [(reader, (url, 100 + r, seconds, scale, env)) for r in range(readers)]
    started: list[tuple[str, Connection, Any]] = []
    report = ChurnReport()
    logs = tempfile.TemporaryDirectory(prefix="dataplane-churn-")
    paths: list[tuple[str, str]] = []
    try:
        for n, (target, args) in enumerate(jobs):
            parent, child = ctx.Pipe()
            path = os.path.join(logs.name, f"{n}-{target.__name__}.stderr")
            paths.append((target.__name__, path))
            proc = ctx.Process(target=_with_stderr_to, args=(path, target, *args, child), daemon=True)
            proc.start()
            child.close()
            started.append((target.__name__, parent, proc))
        deadline = time.monotonic() + join_timeout_s
        for name, parent, _ in started:
            if not parent.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a {name} process did not join {url} within {join_timeout_s:g}s")
            try:
                first = parent.recv()
            except EOFError:
                first = "it exited"
            if first != "ready":  # it failed before joining and sent its result, or died
                report.problems.append(f"{name} could not join: {first}")
        go = not report.problems
        for _, parent, _ in started:
            try:
                parent.send(go)
            except (BrokenPipeError, OSError):
                pass
        if not go:
            return report
        for name, parent, _ in started:
            if not parent.poll(seconds + 120):
                raise TimeoutError(f"a {name} process sent nothing within {seconds + 120:g}s (hung)")
            try:
                answer = parent.recv()
            except EOFError:
                report.problems.append(f"{name} died during the churn")
                continue
            if name == "writer":
                report.writers.append(answer[:2])
                _note(report, name, answer[2])
            elif name == "clearer":
                report.clears = answer[0]
                _note(report, name, answer[1])
            else:
                report.readers.append(answer[:3])
                _note(report, name, answer[3])
                report.last_missing = answer[4] or report.last_missing
    finally:
        for _, _, proc in started:
            proc.join(timeout=60)
            if proc.is_alive():  # a process of this run
                proc.kill()
                proc.join(timeout=10)
        for name, path in paths:
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                report.noise += [f"{name}: {line}" for line in noisy_lines(f.read())]
        logs.cleanup()
    codes = [proc.exitcode for _, _, proc in started]
    if any(codes):
        report.problems.append(f"exit codes {codes}")
    return report


def _note(report: ChurnReport, name: str, problem: str | None) -> None:
    if problem is not None:
        report.problems.append(f"{name}: {problem}")
