"""Object names, put ids, index objects and the per-partition state folded from them (no I/O).

Layout in Mooncake (one namespace ``ns`` per deployment or job):

* ``{ns}/{part}/d/{put_id}/{field}``: one data object per (put call, field): dense rows back to back,
  jagged values back to back, object bytes back to back. A field of 0 bytes has no object.
* ``{ns}/{part}/i/{put_id}.{nbytes}``: one small immutable index object per put call (msgpack):
  the keys, per-field schema, byte size and row offsets, and the tags. A ``kv_clear(keys)`` writes a
  tombstone index (``op="del"``) the same way. The size in the name lets a reader fetch an index it
  has only seen in a listing with one ``batch_get_into`` and no size query.

``part`` and ``field`` are percent-encoded so they hold only ``[A-Za-z0-9_%-]`` (no ``/`` and nothing
a regex treats specially). A ``put_id`` is ``{time_ns:019d}-{writer}``: sortable by time, unique per
writer, strictly increasing within a process. A later put supersedes an earlier one per
(key, field); a tombstone deletes its keys from everything before it.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote, unquote

import msgpack
import numpy as np

from dataplane.errors import BackendUnavailable, InvalidArgument, SchemaError
from dataplane.schema import FieldSchema

__all__ = [
    "FieldEntry",
    "PartitionState",
    "PutIndex",
    "Resolved",
    "data_key",
    "decode_index",
    "encode_index",
    "index_lines",
    "index_prefix",
    "make_index",
    "new_put_id",
    "parse_index_key",
    "part_token",
    "partition_of_token",
    "partition_prefix",
]

INDEX_VERSION = 2  # 2: offsets stored once, named by place; keys one newline-joined str (1: a list of str)
_NS_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ID_LOCK = threading.Lock()
_LAST_NS = 0


def check_ns(ns: str) -> str:
    if not _NS_RE.match(ns):
        raise InvalidArgument(f"namespace {ns!r} must be 1-64 characters from A-Z a-z 0-9 _ -")
    return ns


@functools.lru_cache(maxsize=4096)  # field and partition names repeat on every call
def _token(s: str) -> str:
    return quote(s, safe="").replace(".", "%2E").replace("~", "%7E")


def part_token(partition_id: str) -> str:
    """``train/v1`` -> ``train%2Fv1``: safe inside a key and inside a regex."""
    return _token(partition_id)


def partition_of_token(token: str) -> str:
    return unquote(token)


def index_prefix(ns: str, partition_id: str) -> str:
    return f"{ns}/{part_token(partition_id)}/i/"


def partition_prefix(ns: str, partition_id: str) -> str:
    return f"{ns}/{part_token(partition_id)}/"


def data_key(head: str, put_id: str, field: str) -> str:
    """The data object of ``field`` in put ``put_id``; ``head`` is :func:`partition_prefix`."""
    return f"{head}d/{put_id}/{_token(field)}"


def data_prefix(ns: str, partition_id: str) -> str:
    """What every data object of the partition begins with (:func:`data_key`)."""
    return f"{partition_prefix(ns, partition_id)}d/"


def is_index_key(key: str) -> bool:
    """Whether ``key`` is an index object (``{ns}/{partition}/i/{put id}.{bytes}``) rather than a data
    object (``{ns}/{partition}/d/{put id}/{field}``); partitions and fields are tokens without ``/``."""
    parts = key.rsplit("/", 2)
    return len(parts) == 3 and parts[1] == "i"


def new_put_id(writer: str) -> str:
    """Strictly increasing within this process; ordered by wall time across processes and hosts
    (so a rewrite from another host is ordered only as well as the clocks agree)."""
    global _LAST_NS
    with _ID_LOCK:
        t = max(time.time_ns(), _LAST_NS + 1)
        _LAST_NS = t
    return f"{t:019d}-{writer}"


def index_lines(ns: str) -> re.Pattern[bytes]:
    """Finds the index keys of namespace ``ns`` (every partition) in a ``/get_all_keys`` answer with a
    newline put in front (see :func:`dataplane.adapters._mc_handle._lines`)."""
    return re.compile(rb"\n(" + re.escape(ns.encode()) + rb"/[^/\n]+/i/[^\n]*)")


def parse_index_key(key: str, prefix: str) -> tuple[str, int] | None:
    """``{prefix}{put_id}.{nbytes}`` -> (put_id, nbytes), or None for a key of another shape."""
    rest = key[len(prefix) :]
    put_id, dot, size = rest.rpartition(".")
    if not dot or not put_id or not size.isdigit() or "/" in put_id:
        return None
    return put_id, int(size)


@dataclass(frozen=True, slots=True)
class FieldEntry:
    """One field of one put: its schema, object size and where each row's bytes are."""

    schema: FieldSchema
    nbytes: int
    offsets: np.ndarray | None  # int64 [B+1] element offsets (jagged / object); None for dense
    unit: int  # bytes per row (dense) or per element of the leading dim (jagged / object)

    def span(self, i: int) -> tuple[int, int]:
        """Byte offset and byte length of row ``i`` in the data object."""
        if self.offsets is None:
            return i * self.unit, self.unit
        a = int(self.offsets[i])
        return a * self.unit, (int(self.offsets[i + 1]) - a) * self.unit


@dataclass(frozen=True, slots=True)
class PutIndex:
    """A parsed, immutable index object: a put (``op="put"``) or a tombstone (``op="del"``)."""

    key: str
    put_id: str
    op: Literal["put", "del"]
    keys: tuple[str, ...]
    fields: Mapping[str, FieldEntry]
    tags: tuple[dict[str, Any], ...] | None

    def data_key(self, field: str) -> str:
        return data_key(self.key[: self.key.rindex("/i/") + 1], self.put_id, field)

    def object_keys(self) -> list[str]:
        """Every Mooncake key this put owns (data objects first, its index last)."""
        return [self.data_key(f) for f, e in self.fields.items() if e.nbytes] + [self.key]


def make_index(
    key: str,
    put_id: str,
    keys: Sequence[str],
    fields: Mapping[str, tuple[FieldSchema, int, np.ndarray | None]],
    tags: Sequence[Mapping[str, Any]] | None,
) -> PutIndex:
    """The parsed form of what :func:`encode_index` writes (for the writer's own cache)."""
    shared: dict[int, np.ndarray] = {}  # fields that shared one offsets array share its copy
    entries = {}
    for name, (schema, n, off) in fields.items():
        own = None
        if off is not None:
            own = shared.get(id(off))
            if own is None:
                own = shared[id(off)] = np.array(off, dtype=np.int64)
        entries[name] = FieldEntry(schema, int(n), own, schema.row_nbytes)
    return PutIndex(key, put_id, "put", tuple(keys), entries, None if tags is None else tuple(dict(t) for t in tags))


def encode_index(
    keys: Sequence[str],
    fields: Mapping[str, tuple[FieldSchema, int, np.ndarray | None]],
    tags: Sequence[Mapping[str, Any]] | None,
    *,
    op: Literal["put", "del"] = "put",
) -> bytes:
    """msgpack of an index object. ``fields``: name -> (schema, nbytes, element offsets or None).
    Fields sharing one offsets array (the usual per-token fields of a batch) store it once."""
    slots: dict[int, int] = {}  # id(offsets array) -> its place in "offsets"
    blobs: list[bytes] = []
    for _, _, off in fields.values():
        if off is not None and id(off) not in slots:
            slots[id(off)] = len(blobs)
            blobs.append(off.astype("<i8").tobytes())
    body = {
        "v": INDEX_VERSION,
        "op": op,
        "keys": "\n".join(keys),  # keys are printable: one string, split in C when read
        "offsets": blobs,
        "fields": {
            name: {"s": schema.to_dict(), "n": int(n), "o": None if off is None else slots[id(off)]}
            for name, (schema, n, off) in fields.items()
        },
        "tags": None if tags is None else [dict(t) for t in tags],
    }
    out = msgpack.packb(body, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def decode_index(key: str, put_id: str, data: bytes) -> PutIndex:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if body.get("v") != INDEX_VERSION:
            raise ValueError(f"index version {body.get('v')!r}, this dataplane reads {INDEX_VERSION}")
        fields: dict[str, FieldEntry] = {}
        arrays = [np.frombuffer(blob, dtype="<i8").astype(np.int64) for blob in body["offsets"]]
        for name, f in body["fields"].items():
            schema = FieldSchema.from_dict(f["s"])
            slot = f["o"]
            if slot is not None and (type(slot) is not int or not 0 <= slot < len(arrays)):
                raise ValueError(f"field {name!r} names offsets {slot!r} of {len(arrays)}")
            off = None if slot is None else arrays[slot]  # fields sharing offsets share one array
            fields[name] = FieldEntry(schema, int(f["n"]), off, schema.row_nbytes)
        tags = None if body["tags"] is None else tuple(dict(t) for t in body["tags"])
        joined = body["keys"]
        if type(joined) is not str:
            raise ValueError(f"keys are a {type(joined).__name__}, not one str")
        return PutIndex(key, put_id, body["op"], tuple(joined.split("\n")) if joined else (), fields, tags)
    except (ValueError, KeyError, TypeError, SchemaError, msgpack.UnpackException) as e:
        raise BackendUnavailable(
            f"index object {key!r} is unreadable ({type(e).__name__}: {e}); was it written by another "
            "dataplane version? Clear the partition (kv_clear(partition_id=...))"
        ) from e


class _Row:
    __slots__ = ("refs", "tags")

    def __init__(self) -> None:
        self.refs: list[tuple[PutIndex, int]] = []  # oldest first
        self.tags: dict[str, Any] = {}


@dataclass(frozen=True, slots=True)
class Resolved:
    """Where each requested row of one field lives: (put, row index in that put)."""

    schema: FieldSchema
    locs: list[tuple[PutIndex, int]]
    whole: PutIndex | None = None  # set when the rows are exactly this put's rows, in its order


class PartitionState:
    """Keys, fields, tags and schema of one partition, folded from its index objects in put order.

    Folding is incremental while new puts arrive in order (the usual case); anything else (a put
    that was in flight when a newer one was seen, or a removed put) rebuilds from scratch.
    """

    def __init__(self) -> None:
        self.puts: dict[str, PutIndex] = {}  # put_id -> index, every folded put and tombstone
        self.max_id = ""
        self.rows: dict[str, _Row] = {}
        self.schema: dict[str, FieldSchema] = {}
        self.ignored: set[tuple[str, str]] = set()  # (put_id, field) that lost a schema race

    @classmethod
    def build(cls, puts: Iterable[PutIndex]) -> PartitionState:
        st = cls()
        for p in sorted(puts, key=lambda p: p.put_id):
            st.apply(p)
        return st

    def apply(self, p: PutIndex) -> None:
        assert p.put_id > self.max_id, "puts must be folded in put_id order"
        self.puts[p.put_id] = p
        self.max_id = p.put_id
        if p.op == "del":
            for k in p.keys:
                self.rows.pop(k, None)
            return
        for name, entry in p.fields.items():
            known = self.schema.get(name)
            if known is None:
                self.schema[name] = entry.schema
            elif known != entry.schema:  # two writers raced on a new field: first put wins
                self.ignored.add((p.put_id, name))
        for i, k in enumerate(p.keys):
            row = self.rows.get(k)
            if row is None:
                row = self.rows[k] = _Row()
            row.refs.append((p, i))
            if p.tags is not None:
                row.tags.update(p.tags[i])

    def refresh(self, current: Mapping[str, PutIndex]) -> PartitionState:
        """The state for exactly the puts in ``current`` (put_id -> index): self, updated in place
        when only newer puts were added, else a rebuilt one."""
        if self.puts.keys() <= current.keys():
            new = sorted(pid for pid in current if pid not in self.puts)
            if not new or new[0] > self.max_id:
                for pid in new:
                    self.apply(current[pid])
                return self
        return PartitionState.build(current.values())

    def _find(self, row: _Row, field: str) -> tuple[PutIndex, int] | None:
        for p, i in reversed(row.refs):
            if field in p.fields and (p.put_id, field) not in self.ignored:
                return p, i
        return None

    def resolve(
        self, keys: Sequence[str], fields: Sequence[str]
    ) -> tuple[list[str], dict[str, list[str]], dict[str, Resolved]]:
        """(missing keys, field -> keys missing it, field -> where each row lives)."""
        found = [self.rows.get(k) for k in keys]
        missing_keys = [k for k, row in zip(keys, found, strict=True) if row is None]
        if missing_keys:
            return missing_keys, {}, {}
        rows = [row for row in found if row is not None]
        # Common case: every row's newest put is one put P holding the field (one get after one put).
        newest = [row.refs[-1] for row in rows]
        first = newest[0][0]
        shared = all(p is first for p, _ in newest)
        whole = None
        if shared and len(first.keys) == len(keys) and all(i == j for j, (_, i) in enumerate(newest)):
            whole = first
        out: dict[str, Resolved] = {}
        missing: dict[str, list[str]] = {}
        for f in fields:
            schema = self.schema.get(f)
            if schema is None:
                missing[f] = list(keys)
                continue
            if shared and f in first.fields and (first.put_id, f) not in self.ignored:
                out[f] = Resolved(schema, newest, whole)
                continue
            locs: list[tuple[PutIndex, int]] = []
            absent: list[str] = []
            for k, row in zip(keys, rows, strict=True):
                loc = self._find(row, f)
                if loc is None:
                    absent.append(k)
                else:
                    locs.append(loc)
            if absent:
                missing[f] = absent
            else:
                out[f] = Resolved(schema, locs)
        return [], missing, out

    def listing(self) -> dict[str, dict[str, Any]]:
        return {k: dict(row.tags) for k, row in self.rows.items()}

    def garbage_after_delete(self, doomed: Iterable[str]) -> tuple[list[PutIndex], bool]:
        """Plan a ``kv_clear(keys)``: the puts and tombstones nothing reads once ``doomed`` are gone,
        and whether a tombstone for ``doomed`` is still needed (some surviving put holds one of them).
        """
        gone = set(doomed)
        live: set[str] = set()
        for k, row in self.rows.items():
            if k in gone:
                continue
            seen: set[str] = set()
            for p, i in reversed(row.refs):
                fields = {f for f in p.fields if (p.put_id, f) not in self.ignored}
                if (fields - seen) or (p.tags is not None and p.tags[i]):
                    live.add(p.put_id)
                seen |= fields
        garbage: list[PutIndex] = []
        live_puts = [self.puts[pid] for pid in live]
        for p in self.puts.values():
            if p.op == "put":
                if p.put_id not in live:
                    garbage.append(p)
                continue
            keys = set(p.keys)  # a tombstone stays while an older live put holds one of its keys
            if not any(q.put_id < p.put_id and not keys.isdisjoint(q.keys) for q in live_puts):
                garbage.append(p)
        need_tombstone = any(not gone.isdisjoint(q.keys) for q in live_puts)
        return garbage, need_tombstone
