"""Reader processes for ``benchmarks.put_get --readers N``: N processes get the same batch at once."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

READY_TIMEOUT_S = 180.0
GET_TIMEOUT_S = 600.0


def _reader_main(url: str, options: dict[str, Any], conn: Connection) -> None:
    import dataplane

    try:
        client = dataplane.connect(url, **options)
    except BaseException as e:  # report to the parent instead of dying silently
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, meta, fields = msg
            t0 = time.perf_counter()
            out = client.kv_batch_get(meta, select_fields=fields)
            elapsed = time.perf_counter() - t0
            if out.batch_size[0] != len(meta.keys):
                conn.send(("error", "wrong row count"))
                continue
            del out
            conn.send(("done", elapsed))
    finally:
        client.close()


class ReaderPool:
    """N spawned processes connected to the same store, each getting a meta on request."""

    def __init__(self, n: int, url: str, options: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_reader_main, args=(url, options, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            self._expect(conn, "ready", READY_TIMEOUT_S)

    @staticmethod
    def _expect(conn: Connection, kind: str, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise TimeoutError(f"reader process gave no {kind!r} within {timeout}s")
        got, value = conn.recv()
        if got != kind:
            raise RuntimeError(f"reader process failed: {value}")
        return value

    def get_all(self, meta: Any, fields: list[str]) -> tuple[float, list[float]]:
        """Wall seconds until every reader has the batch, and each reader's own seconds."""
        t0 = time.perf_counter()
        for conn in self.conns:
            conn.send(("get", meta, fields))
        own = [float(self._expect(conn, "done", GET_TIMEOUT_S)) for conn in self.conns]
        return time.perf_counter() - t0, own

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
