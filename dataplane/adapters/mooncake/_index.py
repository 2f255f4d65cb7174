"""Object names, put ids, index objects and the per-partition state folded from them (no I/O).

Layout in Mooncake (one namespace ``ns`` per deployment or job):

* ``{ns}/{part}/d/{put_id}/{field}``: one data object per (put call, field): dense rows back to back,
  jagged values back to back, object bytes back to back. A field of 0 bytes has no object.
* ``{ns}/{part}/d/{put_id}/.all``: instead, for a small put (a rollout put on its own), one data
  object holding every field, each at a 64-byte aligned offset the index names (a packed put): every
  object costs Mooncake a fixed time whatever its size, and such puts are read whole anyway.
* ``{ns}/{part}/i/{put_id}.{nbytes}``: one small immutable index object per put call (msgpack):
  the keys, per-field schema, byte size and row offsets, and the tags. A ``kv_clear(keys)`` writes a
  tombstone index (``op="del"``) the same way. The size in the name lets a reader fetch an index it
  has only seen in a listing with one ``batch_get_into`` and no size query.
* A tag-only put (``kv_batch_put(keys, None, tags=...)``) is an index object alone: its keys and
  tags, no field, no data object. Folded like any put, it makes absent keys rows that hold no field
  and merges its tags into present ones. An index without fields was always well formed, and
  dataplanes that read index version 4 fold it alike, so it needs no new version (their clears,
  though, may collect a tag-only put whose rows have no tags, or a birth put: see below).

Every index object is stored padded to whole pages, and so is every data object of a writer that
sends from its own memory (shared memory, RDMA; its index says so): see :data:`OBJECT_ALIGN`. The
padding bytes are unspecified and never read as data.

``part`` and ``field`` are percent-encoded so they hold only ``[A-Za-z0-9_%-]`` (no ``/`` and nothing
a regex treats specially). A ``put_id`` is ``{time_ns:019d}-{writer}``: sortable by time, unique per
writer, strictly increasing within a process. A later put supersedes an earlier one per
(key, field); a tombstone deletes its keys from everything before it. A partition lists its keys in
the order of their first put since they were last cleared (their *birth* put): a clear keeps the
birth put of every surviving row (see :meth:`PartitionState.garbage_after_delete`), so every reader
folds the same order. Where a clear collects a birth put that only that order still needs, it
writes a *birth marker* in its place first: an index object of the put's keys alone, whose put id
is the collected one's followed by a fresh one (see :func:`birth_marker`).
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

from dataplane._host.slots import NONE, add_keys, described, grown, lookup, merged_tags
from dataplane.codec.jagged import round_up
from dataplane.errors import BackendUnavailable, InvalidArgument, SchemaError
from dataplane.schema import FieldSchema

__all__ = [
    "OBJECT_ALIGN",
    "FieldEntry",
    "ListedPuts",
    "PartitionState",
    "PutIndex",
    "Resolved",
    "birth_marker",
    "data_key",
    "data_keys",
    "decode_index",
    "encode_index",
    "index_lines",
    "index_object_bytes",
    "index_prefix",
    "make_index",
    "new_put_id",
    "pack_layout",
    "packed_key",
    "parse_index_key",
    "part_token",
    "partition_of_token",
    "partition_prefix",
]

# 4: objects padded to a page (see OBJECT_ALIGN); 3: packed puts; 2: offsets stored once, named by
# place; keys one newline-joined str
INDEX_VERSION = 4
_READS = (2, 3, 4)  # versions this dataplane decodes (2 has no packed puts, 2 and 3 no padding)
# A store server copies objects with glibc's memcpy, which streams copies past the caches
# (_servers.STREAMING_COPY_TUNABLE): faster, but several times slower than an ordinary copy where
# the destination lies 1-700 bytes past the source within a page (4K aliasing). Mooncake places each object right after the
# last, so one odd-sized object shifts every later one. A writer that sends from its own memory pads
# every object to a multiple of this (index objects always; data objects where its index says so):
# then objects start on a page in the segment, and reads land them on a page too.
OBJECT_ALIGN = 4096
PACKED = ".all"  # the data object of a packed put: a field's token never holds "."
PACK_ALIGN = 64  # a field's offset in a packed object: any dtype's view of it is aligned
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


def packed_key(head: str, put_id: str) -> str:
    """The one data object of packed put ``put_id``; ``head`` is :func:`partition_prefix`."""
    return f"{head}d/{put_id}/{PACKED}"


def pack_layout(sizes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Where each field of a packed put starts in its object (aligned to :data:`PACK_ALIGN`), and the
    object's size."""
    at, end = {}, 0
    for field, n in sizes.items():
        at[field] = end
        end += round_up(n, PACK_ALIGN)
    return at, end


def index_object_bytes(body_bytes: int) -> int:
    """What an index object of ``body_bytes`` occupies in the store (its key names ``body_bytes``)."""
    return round_up(body_bytes, OBJECT_ALIGN)


def data_keys(puts: Sequence[PutIndex], field: str) -> list[str]:
    """:meth:`PutIndex.data_key` of ``field`` for each of ``puts`` (of one partition), in one pass."""
    if not puts:
        return []
    head, token = puts[0].head, _token(field)
    return [f"{head}d/{p.put_id}/{PACKED if p.packed else token}" for p in puts]


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
    newline put in front (see :func:`dataplane.adapters.mooncake._handle._lines`)."""
    return re.compile(rb"\n(" + re.escape(ns.encode()) + rb"/[^/\n]+/i/[^\n]*)")


def parse_index_key(key: str, prefix: str) -> tuple[str, int] | None:
    """``{prefix}{put_id}.{nbytes}`` -> (put_id, nbytes), or None for a key of another shape."""
    rest = key[len(prefix) :]
    put_id, dot, size = rest.rpartition(".")
    if not dot or not put_id or not size.isdigit() or "/" in put_id:
        return None
    return put_id, int(size)


class ListedPuts:
    """The puts a partition's index lines show, kept across listings: every put lists the partition,
    and a partition can hold thousands of puts (rows put one by one), so lines are matched as sets
    and only lines not seen before are parsed."""

    __slots__ = ("puts", "seen")

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, int] | None] = {}  # line -> (put id, size), None: not an index key
        self.puts: dict[str, tuple[str, int]] = {}  # put id -> (line, size)

    def update(self, lines: Iterable[str], prefix: str) -> dict[str, tuple[str, int]]:
        """Put id -> (index key, size) of every index key of ``prefix`` in ``lines`` (a listing): what
        :func:`parse_index_key` finds in them, the same as parsing every line again (put ids are
        unique: one index object per put). The dict is kept for the next update: read it only."""
        mine = {line for line in lines if line.startswith(prefix)}
        seen, puts = self.seen, self.puts
        for line in seen.keys() - mine:
            parsed = seen.pop(line)
            if parsed is not None and puts.get(parsed[0], ("",))[0] == line:
                del puts[parsed[0]]
        for line in sorted(mine - seen.keys()):
            parsed = seen[line] = parse_index_key(line, prefix)
            if parsed is not None:
                puts[parsed[0]] = (line, parsed[1])
        return puts


@dataclass(frozen=True, slots=True)
class FieldEntry:
    """One field of one put: its schema, object size and where each row's bytes are."""

    schema: FieldSchema
    nbytes: int
    offsets: np.ndarray | None  # int64 [B+1] element offsets (jagged / object); None for dense
    unit: int  # bytes per row (dense) or per element of the leading dim (jagged / object)
    at: int = 0  # where its bytes start in its data object (a packed put's one object; else 0)

    def span(self, i: int) -> tuple[int, int]:
        """Byte offset and byte length of row ``i`` in the data object."""
        if self.offsets is None:
            return self.at + i * self.unit, self.unit
        a = int(self.offsets[i])
        return self.at + a * self.unit, (int(self.offsets[i + 1]) - a) * self.unit


@dataclass(frozen=True, slots=True)
class PutIndex:
    """A parsed, immutable index object: a put (``op="put"``) or a tombstone (``op="del"``)."""

    key: str
    put_id: str
    op: Literal["put", "del"]
    keys: tuple[str, ...]
    fields: Mapping[str, FieldEntry]
    tags: tuple[dict[str, Any], ...] | None
    packed: int = 0  # bytes of the one data object holding every field (a packed put); 0: one per field
    pad: int = 1  # its data objects are padded to a multiple of this (1: stored as they are)

    def stored(self, nbytes: int) -> int:
        """Bytes a data object of this put holding ``nbytes`` occupies in the store (what reading it whole
        takes)."""
        return round_up(nbytes, self.pad)

    @property
    def head(self) -> str:
        """:func:`partition_prefix` of its partition."""
        return self.key[: self.key.rindex("/i/") + 1]

    def data_key(self, field: str) -> str:
        """The object holding ``field``'s bytes (at ``fields[field].at``)."""
        return packed_key(self.head, self.put_id) if self.packed else data_key(self.head, self.put_id, field)

    def object_keys(self) -> list[str]:
        """Every Mooncake key this put owns (data objects first, its index last)."""
        if self.packed:
            return [packed_key(self.head, self.put_id), self.key]
        return [self.data_key(f) for f, e in self.fields.items() if e.nbytes] + [self.key]


def make_index(
    key: str,
    put_id: str,
    keys: Sequence[str],
    fields: Mapping[str, tuple[FieldSchema, int, np.ndarray | None]],
    tags: Sequence[Mapping[str, Any]] | None,
    packed: tuple[Mapping[str, int], int] | None = None,
    pad: int = 1,
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
        entries[name] = FieldEntry(schema, int(n), own, schema.row_nbytes, 0 if packed is None else packed[0][name])
    return PutIndex(
        key,
        put_id,
        "put",
        tuple(keys),
        entries,
        None if tags is None else tuple(dict(t) for t in tags),
        0 if packed is None else packed[1],
        pad,
    )


def encode_index(
    keys: Sequence[str],
    fields: Mapping[str, tuple[FieldSchema, int, np.ndarray | None]],
    tags: Sequence[Mapping[str, Any]] | None,
    *,
    op: Literal["put", "del"] = "put",
    packed: tuple[Mapping[str, int], int] | None = None,
    pad: int = 1,
) -> bytes:
    """msgpack of an index object. ``fields``: name -> (schema, nbytes, element offsets or None).
    Fields sharing one offsets array (the usual per-token fields of a batch; the store passes equal
    arrays as one) store it once.
    ``packed``: (field -> offset, object bytes) of a packed put (see :func:`pack_layout`).
    ``pad``: its data objects are padded to a multiple of this (see :data:`OBJECT_ALIGN`)."""
    slots: dict[int, int] = {}  # id(offsets array) -> its place in "offsets"
    blobs: list[bytes] = []
    for _, _, off in fields.values():
        if off is not None and id(off) not in slots:
            slots[id(off)] = len(blobs)
            blobs.append(off.astype("<i8").tobytes())
    entries: dict[str, dict[str, Any]] = {
        name: {"s": schema.to_dict(), "n": int(n), "o": None if off is None else slots[id(off)]}
        for name, (schema, n, off) in fields.items()
    }
    body: dict[str, Any] = {
        "v": INDEX_VERSION,
        "op": op,
        "keys": "\n".join(keys),  # keys are printable: one string, split in C when read
        "offsets": blobs,
        "fields": entries,
        "tags": None if tags is None else [dict(t) for t in tags],
    }
    if pad != 1:
        body["g"] = pad
    if packed is not None:
        body["p"] = packed[1]
        for name, at in packed[0].items():
            entries[name]["a"] = at
    out = msgpack.packb(body, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def decode_index(key: str, put_id: str, data: bytes) -> PutIndex:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if body.get("v") not in _READS:
            raise ValueError(f"index version {body.get('v')!r}, this dataplane reads {_READS}")
        packed, pad = body.get("p", 0), body.get("g", 1)
        if type(packed) is not int or packed < 0:
            raise ValueError(f"packed object size {packed!r}")
        if pad not in (1, OBJECT_ALIGN):
            raise ValueError(f"objects padded to {pad!r} bytes")
        fields: dict[str, FieldEntry] = {}
        arrays = [np.frombuffer(blob, dtype="<i8").astype(np.int64) for blob in body["offsets"]]
        for name, f in body["fields"].items():
            schema = FieldSchema.from_dict(f["s"])
            slot = f["o"]
            if slot is not None and (type(slot) is not int or not 0 <= slot < len(arrays)):
                raise ValueError(f"field {name!r} names offsets {slot!r} of {len(arrays)}")
            off = None if slot is None else arrays[slot]  # fields sharing offsets share one array
            n, at = int(f["n"]), f.get("a", 0)
            if type(at) is not int or at < 0 or at % PACK_ALIGN or (packed and at + n > packed) or (at and not packed):
                raise ValueError(f"field {name!r} at byte {at!r} of a {packed}-byte object")
            fields[name] = FieldEntry(schema, n, off, schema.row_nbytes, at)
        tags = None if body["tags"] is None else tuple(dict(t) for t in body["tags"])
        joined = body["keys"]
        if type(joined) is not str:
            raise ValueError(f"keys are a {type(joined).__name__}, not one str")
        keys = tuple(joined.split("\n")) if joined else ()
        return PutIndex(key, put_id, body["op"], keys, fields, tags, packed, pad)
    except (ValueError, KeyError, TypeError, SchemaError, msgpack.UnpackException) as e:
        raise BackendUnavailable(
            f"index object {key!r} is unreadable ({type(e).__name__}: {e}); was it written by another "
            "dataplane version? Clear the partition (kv_clear(partition_id=...))"
        ) from e


@dataclass(frozen=True, slots=True, eq=False)
class Resolved:
    """Where each requested row of one field lives: row ``j`` is row ``rows[j]`` of put
    ``puts[which[j]]``. Fields resolved alike share ``which`` and ``rows`` (the same arrays)."""

    schema: FieldSchema
    puts: tuple[PutIndex, ...]  # the puts the rows come from, each once
    which: np.ndarray  # int64 [rows]: index into ``puts``
    rows: np.ndarray  # int64 [rows]: row index in that put
    whole: PutIndex | None = None  # set when the rows are exactly this put's rows, in its order

    def locs(self) -> list[tuple[PutIndex, int]]:
        """(put, row in it) per row: a readable form for tests and debugging."""
        return [(self.puts[w], i) for w, i in zip(self.which.tolist(), self.rows.tolist(), strict=True)]


class PartitionState:
    """Keys, fields, tags and schema of one partition, folded from its index objects in put order.

    Folding is incremental while new puts arrive in order (the usual case); anything else (a put
    that was in flight when a newer one was seen, or a removed put) rebuilds from scratch.

    Rows are columns, not objects: each live key has a slot, and each field an array over slots of
    the newest put holding it (by fold number) and the row in that put. A batch of 64K rows would
    otherwise be 64K objects to allocate, for the garbage collector to walk again and again, and to
    visit one by one on every get.
    """

    def __init__(self) -> None:
        self.puts: dict[str, PutIndex] = {}  # put_id -> index, every folded put and tombstone
        self.max_id = ""
        self.rows: dict[str, int] = {}  # live key -> its slot (a removed key's slot is not reused)
        self.schema: dict[str, FieldSchema] = {}
        self.ignored: set[tuple[str, str]] = set()  # (put_id, field) that lost a schema race
        self._folded: list[PutIndex] = []  # puts (not tombstones) by fold number
        self._slots = 0  # slots handed out
        self._newest: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # field -> (fold number, row) per slot
        self._tagged: list[tuple[int, np.ndarray]] = []  # (fold number, slot of each row) of puts with tags
        # per slot: the fold number of the put that gave it (its key's first put since it was last cleared)
        self._born = np.zeros(0, dtype=np.int64)

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
        number = len(self._folded)
        slots = self._slots_of(p.keys, number)
        self._folded.append(p)
        at = np.arange(len(p.keys), dtype=np.int64)
        for name, entry in p.fields.items():
            known = self.schema.get(name)
            if known is None:
                self.schema[name] = entry.schema
            elif known != entry.schema:  # two writers raced on a new field: first put wins
                self.ignored.add((p.put_id, name))
                continue
            put_no, row = self._field(name)
            put_no[slots] = number
            row[slots] = at
        if p.tags is not None:
            self._tagged.append((number, slots))

    def _slots_of(self, keys: Sequence[str], number: int) -> np.ndarray:
        """The slot of each of ``keys`` (distinct), new keys getting new ones, born in put ``number``."""
        slots = lookup(self.rows, keys)
        fresh = np.flatnonzero(slots == NONE)
        if len(fresh):
            new = np.arange(self._slots, self._slots + len(fresh))
            add_keys(self.rows, keys, slots, fresh, new)
            self._slots += len(fresh)
            if self._slots > len(self._born):
                self._born = grown(self._born, max(self._slots, 2 * len(self._born), 1024))
            self._born[new] = number
            have = len(next(iter(self._newest.values()))[0]) if self._newest else 0
            if self._slots > have:  # grow every field's columns (doubling)
                size = max(self._slots, 2 * have, 1024)
                for name, (put_no, row) in self._newest.items():
                    self._newest[name] = (grown(put_no, size), grown(row, size))
        return slots

    def _field(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        cols = self._newest.get(name)
        if cols is None:
            size = max(self._slots, len(next(iter(self._newest.values()))[0]) if self._newest else 1024)
            cols = self._newest[name] = (np.full(size, NONE, dtype=np.int64), np.zeros(size, dtype=np.int64))
        return cols

    def refresh(self, current: Mapping[str, PutIndex]) -> PartitionState:
        """The state for exactly the puts in ``current`` (put_id -> index): self, updated in place
        when only newer puts were added, else a rebuilt one."""
        if self.puts.keys() <= current.keys():
            new = sorted(current.keys() - self.puts.keys())
            if not new or new[0] > self.max_id:
                for put_id in new:
                    self.apply(current[put_id])
                return self
        return PartitionState.build(current.values())

    def resolve(
        self, keys: Sequence[str], fields: Sequence[str]
    ) -> tuple[list[str], dict[str, list[str]], dict[str, Resolved]]:
        """(missing keys, field -> keys missing it, field -> where each row lives)."""
        slots = lookup(self.rows, keys)
        if (slots == NONE).any():
            return [keys[i] for i in np.flatnonzero(slots == NONE).tolist()], {}, {}
        out: dict[str, Resolved] = {}
        missing: dict[str, list[str]] = {}
        alike: list[tuple[np.ndarray, Resolved]] = []  # fields resolved alike share one resolution's arrays
        for f in fields:
            schema = self.schema.get(f)
            cols = self._newest.get(f)
            if schema is None or cols is None:
                missing[f] = list(keys)
                continue
            put_no, row = cols[0][slots], cols[1][slots]
            if (put_no == NONE).any():
                missing[f] = [keys[j] for j in np.flatnonzero(put_no == NONE).tolist()]
                continue
            same = next((r for n, r in alike if np.array_equal(n, put_no) and np.array_equal(r.rows, row)), None)
            if same is None:
                same = self._resolved(schema, put_no, row, len(keys))
                alike.append((put_no, same))
            out[f] = Resolved(schema, same.puts, same.which, same.rows, same.whole)
        return [], missing, out

    def _resolved(self, schema: FieldSchema, put_no: np.ndarray, row: np.ndarray, n: int) -> Resolved:
        first = int(put_no[0])
        if (put_no == first).all():
            p = self._folded[first]
            whole = p if len(p.keys) == n and bool((row == np.arange(n)).all()) else None
            return Resolved(schema, (p,), np.zeros(n, dtype=np.int64), row, whole)
        numbers, which = np.unique(put_no, return_inverse=True)
        return Resolved(schema, tuple(self._folded[i] for i in numbers.tolist()), which.reshape(-1), row)

    def listing(self) -> dict[str, dict[str, Any]]:
        """Every live key with its tags (merged over the puts that wrote it, in order), in the order of
        their birth puts."""
        return merged_tags(((slots, self._folded[n].tags or ()) for n, slots in self._tagged), self.rows)

    def describe(self, keys: Sequence[str]) -> list[tuple[frozenset[str], dict[str, Any]] | None]:
        """Per key of ``keys``: the fields its row holds and its merged tags, or None where it is not a
        live key. From the folded state alone: no field read, no pass over the other rows."""
        return described(
            lookup(self.rows, keys),
            {name: put_no for name, (put_no, _) in self._newest.items()},
            ((slots, self._folded[n].tags) for n, slots in self._tagged),
        )

    def garbage_after_delete(self, doomed: Iterable[str]) -> tuple[list[PutIndex], bool, list[PutIndex]]:
        """Plan a ``kv_clear(keys)``: the puts and tombstones nothing reads once ``doomed`` are gone,
        whether a tombstone for ``doomed`` is still needed (some surviving put holds one of them), and
        the puts among that garbage whose :func:`birth_marker` the clear must write before removing them.

        A put stays live while it holds the newest value of a field, or tags, of a surviving row. A
        surviving row's birth put is needed too (it keeps a tag-only row, which may have no tags, and
        the partition's listing order for every reader that folds the puts again), but only as an
        index: one that holds data objects and nothing else a survivor reads is collected, replaced
        by its birth marker (its keys, no field, no data, folded in its place), so a row rewritten
        in full does not keep the bytes of its first put.
        """
        gone = set(doomed)
        rows = self.rows
        survivors = np.fromiter(
            (s for k, s in rows.items() if k not in gone), np.int64, len(rows) - len(gone & rows.keys())
        )
        numbers: set[int] = set()
        for put_no, _ in self._newest.values():
            numbers.update(np.unique(put_no[survivors]).tolist())
        alive = np.zeros(self._slots, dtype=bool)
        alive[survivors] = True
        for number, slots in self._tagged:
            put_tags = self._folded[number].tags
            assert put_tags is not None
            if number not in numbers:
                tagged = np.fromiter(map(bool, put_tags), bool, len(put_tags))
                if (alive[slots] & tagged).any():
                    numbers.add(number)
        reborn: list[PutIndex] = []  # birth puts needed only as an index: replaced by a marker
        for number in np.unique(self._born[survivors]).tolist():
            if number not in numbers:
                p = self._folded[number]
                if p.packed or any(e.nbytes for e in p.fields.values()):
                    reborn.append(p)
                else:  # an index alone already (a tag-only put, a marker): kept as it is
                    numbers.add(number)
        live = {self._folded[i].put_id for i in numbers if i != NONE}
        garbage: list[PutIndex] = []
        # the puts that hold keys once the clear is done (a marker holds the keys of its put, in its place)
        live_puts = [self.puts[put_id] for put_id in live] + reborn
        for p in self.puts.values():
            if p.op == "put":
                if p.put_id not in live:
                    garbage.append(p)
                continue
            keys = set(p.keys)  # a tombstone stays while an older live put holds one of its keys
            if not any(q.put_id < p.put_id and not keys.isdisjoint(q.keys) for q in live_puts):
                garbage.append(p)
        need_tombstone = any(not gone.isdisjoint(q.keys) for q in live_puts)
        return garbage, need_tombstone, reborn


def birth_marker(p: PutIndex, writer: str) -> tuple[PutIndex, bytes]:
    """The index object (parsed, and its body) that stands in for put ``p`` as its keys' birth put
    once ``p`` is collected (see :meth:`PartitionState.garbage_after_delete`): ``p``'s keys, no field,
    no tags, no data object. Its put id is ``p``'s followed by a fresh one of ``writer``: no put id
    begins with another (a time of 19 digits, a writer name of one length), so it sorts right after
    ``p`` and before every later put, and two clears
    that replace ``p`` at once write two objects (never one over the other, which a reader might be
    reading), the second of them a no-op to fold and collected by a later clear."""
    put_id = f"{p.put_id}-{new_put_id(writer)}"
    body = encode_index(p.keys, {}, None)
    key = f"{p.head}i/{put_id}.{len(body)}"
    return make_index(key, put_id, p.keys, {}, None), body
