"""Object names, put ids and index objects (no I/O); the per-partition state folded from them is
:mod:`._fold`.

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

* ``{ns}/{part}/c/{task}/{row id}``: a claim marker, one per (row, task) that claimed it, written put-if-absent
  and holding its claimant's token (:mod:`._claims`); ``{ns}/{part}/f``: the partition's finished
  mark. Neither is an index object, so listings, gets and the schema check never see them.

Every index object is stored padded to whole pages, and so is every data object of a writer that
sends from its own memory (shared memory, RDMA; its index says so): see :data:`OBJECT_ALIGN`. The
padding bytes are unspecified and never read as data.

Keys (any the core accepts: :func:`dataplane.meta.check_keys`) are never part of an object name:
they live in index objects only, as one newline-joined string, or as a list of strings where a key
holds a newline (:func:`_joined_keys`; a dataplane that predates it cannot read such an index, and
no key it could write holds one, so every index it wrote reads as it did).

``part`` and ``field`` are percent-encoded so they hold only ``[A-Za-z0-9_%-]`` (no ``/`` and nothing
a regex treats specially). A ``put_id`` is ``{time_ns:019d}-{writer}``: sortable by time, unique per
writer, strictly increasing within a process. A later put supersedes an earlier one per
(key, field); a tombstone deletes its keys from everything before it. A partition lists its keys in
the order of their first put since they were last cleared (their *birth* put): a clear keeps the
birth put of every surviving row (see :meth:`._fold.PartitionState.garbage_after_delete`), so every reader
folds the same order. Where a clear collects a birth put that only that order still needs, it
writes a *birth marker* in its place first: an index object of the put's keys alone, whose put id
is the collected one's followed by a fresh one (see :func:`._fold.birth_marker`).
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

from dataplane.codec.jagged import round_up
from dataplane.errors import BackendUnavailable, InvalidArgument, SchemaError
from dataplane.schema import FieldSchema

__all__ = [
    "OBJECT_ALIGN",
    "claims_prefix",
    "FieldEntry",
    "ListedPuts",
    "PutIndex",
    "data_key",
    "data_keys",
    "decode_index",
    "encode_index",
    "finished_key",
    "index_and_claim_lines",
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


def claims_prefix(ns: str, partition_id: str, task_name: str | None = None) -> str:
    """What the claim markers of the partition (of one task, when given) begin with."""
    head = f"{partition_prefix(ns, partition_id)}c/"
    return head if task_name is None else f"{head}{_token(task_name)}/"


def finished_key(ns: str, partition_id: str) -> str:
    """The object that marks the partition finished (``mark_finished``)."""
    return f"{partition_prefix(ns, partition_id)}f"


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


def index_and_claim_lines(ns: str, claims_head: str, extra: str = "") -> re.Pattern[bytes]:
    """As :func:`index_lines`, and also the keys beginning with ``claims_head`` (claim markers, see
    :func:`claims_prefix`) and the key ``extra`` when given: one listing serves a clear or a claim."""
    alternatives = rb"(?:" + re.escape(ns.encode()) + rb"/[^/\n]+/i/|" + re.escape(claims_head.encode()) + rb")[^\n]*"
    if extra:
        alternatives += rb"|" + re.escape(extra.encode())
    return re.compile(rb"\n(" + alternatives + rb")(?=\n|$)")


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
        "keys": _joined_keys(keys),
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


def _joined_keys(keys: Sequence[str]) -> str | list[str]:
    """An index's keys: one newline-joined str (split in C when read), or, where a key holds a
    newline itself, the list of them (a msgpack array: the same keys, read slower)."""
    joined = "\n".join(keys)
    if joined.count("\n") == max(0, len(keys) - 1):
        return joined
    return list(keys)


def _split_keys(stored: object) -> tuple[str, ...]:
    """The keys :func:`_joined_keys` stored."""
    if type(stored) is str:
        return tuple(stored.split("\n")) if stored else ()
    if type(stored) is list and all(type(k) is str for k in stored):
        return tuple(stored)
    raise ValueError(f"keys are a {type(stored).__name__}, not one str or a list of str")


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
        keys = _split_keys(body["keys"])
        return PutIndex(key, put_id, body["op"], keys, fields, tags, packed, pad)
    except (ValueError, KeyError, TypeError, SchemaError, msgpack.UnpackException) as e:
        raise BackendUnavailable(
            f"index object {key!r} is unreadable ({type(e).__name__}: {e}); was it written by another "
            "dataplane version? Clear the partition (kv_clear(partition_id=...))"
        ) from e
