"""``sqlite://PATH``: a dataplane adapter that keeps rows in one SQLite file.

The worked example of docs/extending.md. Each (partition, key, field) is one SQLite row holding
that row's bytes in wire form, and the schema of each (partition, field) is stored beside them. A
put is one transaction that checks the schema, writes and checks capacity: all-or-nothing, also
between processes that share the file. ``sqlite://`` (no path) is a private in-memory database.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import pairwise
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch

from dataplane import RowInfo
from dataplane.checks import check_bytes
from dataplane.errors import BackendUnavailable, CapacityExceeded, DataPlaneTimeout, InvalidArgument
from dataplane.storage import (
    Capabilities,
    Column,
    FieldSchema,
    KVBatchMeta,
    KVStore,
    Listing,
    check_compatible,
    missing_rows_error,
)
from dataplane.store_client import StoreClient

__all__ = ["SqliteStore", "connect"]

_TABLES = """
CREATE TABLE IF NOT EXISTS schemas (part TEXT, field TEXT, schema TEXT, PRIMARY KEY (part, field));
CREATE TABLE IF NOT EXISTS keys (part TEXT, key TEXT, tags TEXT, PRIMARY KEY (part, key));
CREATE TABLE IF NOT EXISTS cells (part TEXT, key TEXT, field TEXT, n INTEGER, data BLOB,
                                  PRIMARY KEY (part, key, field));
"""
_CHUNK = 500  # keys per statement: SQLite bounds the parameters of one statement


def _chunks(keys: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(keys), _CHUNK):
        yield keys[i : i + _CHUNK]


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _row_bytes(col: Column) -> list[tuple[int, bytes]]:
    """(length in leading-dim units, bytes) of each row of a column in wire form."""
    flat = col.values.contiguous().reshape(-1).view(torch.uint8).numpy()
    unit = col.schema.row_nbytes
    if col.offsets is None:  # dense: one unit per row
        return [(1, flat[i * unit : (i + 1) * unit].tobytes()) for i in range(col.num_rows)]
    cuts = col.offsets.tolist()  # jagged and object: rows are runs of the values
    return [(b - a, flat[a * unit : b * unit].tobytes()) for a, b in pairwise(cuts)]


def _column(schema: FieldSchema, rows: Sequence[tuple[int, bytes]]) -> Column:
    """The rows back in wire form, in memory the caller owns."""
    data = b"".join(blob for _, blob in rows)
    raw = torch.empty(len(data), dtype=torch.uint8)
    raw.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    lengths = torch.tensor([n for n, _ in rows], dtype=torch.int64)
    values = schema.view_rows(raw, int(lengths.sum()))
    if schema.kind == "dense":
        return Column(schema, values)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return Column(schema, values, offsets)


class SqliteStore(KVStore):
    """Rows in one SQLite database (a file, or memory when ``path`` is None)."""

    def __init__(
        self, path: str | None = None, *, capacity_bytes: int | None = None, capacity_rows: int | None = None
    ) -> None:
        self._db = sqlite3.connect(path or ":memory:", isolation_level=None, check_same_thread=False)
        self._db.executescript(_TABLES)
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for a writer
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        self._limits = (capacity_bytes, capacity_rows)
        self._caps = Capabilities(backend="sqlite", cross_process=path is not None, cross_node=False)

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @contextmanager
    def _transaction(self, timeout_s: float, *, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction; SQLite's own errors leave it as typed dataplane errors, after a rollback."""
        if not self._lock.acquire(timeout=timeout_s):
            raise DataPlaneTimeout(f"sqlite store busy for {timeout_s}s; raise timeout_s")
        try:
            self._db.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")  # waits for other processes
            self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            code = getattr(e, "sqlite_errorcode", None)
            if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise DataPlaneTimeout(f"sqlite database locked for over {timeout_s}s; raise timeout_s") from e
            if code == sqlite3.SQLITE_FULL:
                raise CapacityExceeded(f"sqlite database is full ({e}); clear consumed rows") from e
            raise BackendUnavailable(f"sqlite failed: {e}") from e
        finally:
            self._lock.release()

    @staticmethod
    def _schemas(db: sqlite3.Connection, partition_id: str) -> dict[str, FieldSchema]:
        found = db.execute("SELECT field, schema FROM schemas WHERE part = ?", (partition_id,))
        return {field: FieldSchema.from_dict(json.loads(text)) for field, text in found}

    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        *,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        cells = [
            (partition_id, key, field, n, blob)
            for field, col in columns.items()
            for key, (n, blob) in zip(keys, _row_bytes(col), strict=True)
        ]
        with self._transaction(timeout_s, write=True) as db:
            known = self._schemas(db, partition_id)
            for field, col in columns.items():  # before any write; a failure rolls back anyway
                if field in known:
                    check_compatible(partition_id, field, known[field], col.schema)
            db.executemany(
                "INSERT INTO schemas VALUES (?, ?, ?)",
                [(partition_id, f, json.dumps(c.schema.to_dict())) for f, c in columns.items() if f not in known],
            )
            old: dict[str, dict[str, Any]] = {}
            for chunk in _chunks(keys):
                query = f"SELECT key, tags FROM keys WHERE part = ? AND key IN ({_marks(len(chunk))})"
                old.update((k, json.loads(t)) for k, t in db.execute(query, (partition_id, *chunk)))
            new_tags = [{**old.get(k, {}), **(tags[i] if tags is not None else {})} for i, k in enumerate(keys)]
            db.executemany(  # an upsert keeps a key's rowid: the listing's first-put order
                "INSERT INTO keys VALUES (?, ?, ?) ON CONFLICT (part, key) DO UPDATE SET tags = excluded.tags",
                [(partition_id, k, json.dumps(t)) for k, t in zip(keys, new_tags, strict=True)],
            )
            db.executemany("INSERT OR REPLACE INTO cells VALUES (?, ?, ?, ?, ?)", cells)
            self._check_capacity(db)  # after writing: the rollback undoes a put that does not fit
        return None

    def _check_capacity(self, db: sqlite3.Connection) -> None:
        max_bytes, max_rows = self._limits
        if max_rows is not None and (rows := db.execute("SELECT COUNT(*) FROM keys").fetchone()[0]) > max_rows:
            raise CapacityExceeded(f"this put would hold {rows} rows, over capacity_rows={max_rows}; clear some")
        if max_bytes is not None:
            held = db.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM cells").fetchone()[0]
            if held > max_bytes:
                raise CapacityExceeded(f"this put would hold {held} bytes, over capacity_bytes={max_bytes}")

    def get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> Mapping[str, Column]:
        cells: dict[tuple[str, str], tuple[int, bytes]] = {}
        present: set[str] = set()
        with self._transaction(timeout_s, write=False) as db:  # one consistent snapshot
            schemas = self._schemas(db, partition_id)
            for chunk in _chunks(keys):
                marks, args = _marks(len(chunk)), (partition_id, *chunk)
                present.update(
                    k for (k,) in db.execute(f"SELECT key FROM keys WHERE part = ? AND key IN ({marks})", args)
                )
                for field in fields:
                    query = f"SELECT key, n, data FROM cells WHERE part = ? AND key IN ({marks}) AND field = ?"
                    cells.update(((field, k), (n, d)) for k, n, d in db.execute(query, (*args, field)))
        if len(present) < len(keys):
            raise missing_rows_error(partition_id, [k for k in keys if k not in present])
        lacking = {f: [k for k in keys if (f, k) not in cells] for f in fields}
        if any(lacking.values()):
            raise missing_rows_error(partition_id, (), {f: ks for f, ks in lacking.items() if ks})
        return {f: _column(schemas[f], [cells[(f, k)] for k in keys]) for f in fields}

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        with self._transaction(timeout_s, write=True) as db:
            if keys is None:
                for table in ("cells", "keys", "schemas"):
                    db.execute(f"DELETE FROM {table} WHERE part = ?", (partition_id,))
                return
            for chunk in _chunks(keys):
                for table in ("cells", "keys"):
                    db.execute(
                        f"DELETE FROM {table} WHERE part = ? AND key IN ({_marks(len(chunk))})", (partition_id, *chunk)
                    )
            if db.execute("SELECT 1 FROM keys WHERE part = ? LIMIT 1", (partition_id,)).fetchone() is None:
                db.execute("DELETE FROM schemas WHERE part = ?", (partition_id,))  # its last row went

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        out: Listing = {}
        with self._transaction(timeout_s, write=False) as db:
            where, args = ("WHERE part = ?", (partition_id,)) if partition_id is not None else ("", ())
            for part, key, tags in db.execute(f"SELECT part, key, tags FROM keys {where} ORDER BY rowid", args):
                out.setdefault(part, {})[key] = json.loads(tags)
        return out

    def describe(self, partition_id: str, keys: Sequence[str], *, timeout_s: float) -> builtins.list[RowInfo | None]:
        tags: dict[str, dict[str, Any]] = {}
        fields: dict[str, set[str]] = {}
        with self._transaction(timeout_s, write=False) as db:  # one consistent snapshot
            for chunk in _chunks(keys):
                marks, args = _marks(len(chunk)), (partition_id, *chunk)
                query = f"SELECT key, tags FROM keys WHERE part = ? AND key IN ({marks})"
                tags.update((k, json.loads(t)) for k, t in db.execute(query, args))
                for k, f in db.execute(f"SELECT key, field FROM cells WHERE part = ? AND key IN ({marks})", args):
                    fields.setdefault(k, set()).add(f)
        return [RowInfo(frozenset(fields.get(k, ())), tags[k]) if k in tags else None for k in keys]

    def close(self) -> None:
        with self._lock:
            self._db.close()  # idempotent; StoreClient calls it once anyway


def connect(url: str = "sqlite://", **options: Any) -> StoreClient:
    """Open ``sqlite://`` (private, in memory) or ``sqlite:///path/to/file.db`` (shared by the
    processes that open the same file). Options, as keywords or URL query parameters:
    ``timeout_s`` (default 60), ``capacity_bytes`` and ``capacity_rows`` (default unbounded)."""
    parsed = urlparse(url)
    if parsed.scheme != "sqlite":
        raise InvalidArgument(f"not a sqlite:// URL: {url!r}")
    given = {**{k: v[-1] for k, v in parse_qs(parsed.query).items()}, **options}
    unknown = set(given) - {"timeout_s", "capacity_bytes", "capacity_rows"}
    if unknown:
        raise InvalidArgument(
            f"unknown sqlite:// options {sorted(unknown)}; known: timeout_s, capacity_bytes, capacity_rows"
        )
    try:
        timeout_s = float(given.get("timeout_s", 60.0))
        limits = {k: int(given[k]) for k in ("capacity_rows",) if given.get(k) is not None}
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"bad sqlite:// option in {url!r} {options}: {e}") from None
    if given.get("capacity_bytes") is not None:  # sizes as every backend takes them: 67108864, "64MiB"
        limits["capacity_bytes"] = check_bytes("capacity_bytes", given["capacity_bytes"])
    store = SqliteStore((parsed.netloc + parsed.path) or None, **limits)
    return StoreClient(store, timeout_s=timeout_s)
