"""The per-partition state a reader folds from a partition's index objects (no I/O): which put holds
each row's field, the listing in first-put order, what a clear may collect, and the birth markers
that keep that order across clears. Object names and the index format: :mod:`._index`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataplane._host.slots import NONE, add_keys, described, grown, lookup, merged_tags
from dataplane.adapters.mooncake._index import (
    PutIndex,
    encode_index,
    make_index,
    new_put_id,
)
from dataplane.schema import FieldSchema

__all__ = ["PartitionState", "Resolved", "birth_marker"]


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

    def row_ids(self, keys: Sequence[str]) -> list[str | None]:
        """Per key of ``keys``: an id of its row that no other row of the partition, before or after,
        has (None where it is not a live key): the put id its key was first put by since it was last
        cleared, and a digest of the key. A birth marker keeps the id: its put id begins with the put
        id it stands in for (:func:`birth_marker`)."""
        out: list[str | None] = []
        for k, s in zip(keys, lookup(self.rows, keys).tolist(), strict=True):
            if s == NONE:
                out.append(None)
                continue
            born = "-".join(self._folded[int(self._born[s])].put_id.split("-", 2)[:2])
            out.append(f"{born}.{hashlib.blake2b(k.encode(), digest_size=12).hexdigest()}")
        return out

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
