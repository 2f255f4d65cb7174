"""Gets of the Mooncake store: a get of exactly the rows of the meta's put starts its read from the
meta's read hint alone; any other get lists, resolves and plans its reads first. Every read is
trusted only once the puts it read from are still there after it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dataplane._host.threads import usable_cpus
from dataplane.adapters.mooncake._fold import PartitionState, Resolved
from dataplane.adapters.mooncake._index import (
    OBJECT_ALIGN,
    PutIndex,
    data_key,
    decode_index,
    index_prefix,
    packed_key,
    parse_index_key,
    partition_prefix,
)
from dataplane.adapters.mooncake._partitions import HINT_KEY, READ_KEY, PartitionCache, _Part
from dataplane.adapters.mooncake._put import _PACK_MAX_BYTES
from dataplane.adapters.mooncake._read import Landing, ReadOp, Vanished
from dataplane.codec.jagged import round_up
from dataplane.codec.wire import Column
from dataplane.errors import (
    BackendUnavailable,
    DataPlaneTimeout,
    KeyNotFound,
    missing_rows_error,
)
from dataplane.meta import KVBatchMeta
from dataplane.storage import PendingGet

__all__ = ["Gets"]

_EARLY_MAX_BYTES = 1 << 30  # larger gets take their sizes from the index (their fixed costs matter less)
# On a host of fewer than _BESIDE_GATED_BELOW_CPUS usable CPUs, planning and decoding beside a read of
# at least _BESIDE_MIN_BYTES start _BESIDE_AFTER_S after the read is issued (see _Gate); smaller reads
# end before waiting would pay.
_BESIDE_GATED_BELOW_CPUS = 4
_BESIDE_MIN_BYTES = 2 << 20
_BESIDE_AFTER_S = 0.0003


class _Gate:
    """Holds a get's Python that runs beside its read (planning, decoding) until the read is under way.

    On a small host, Python run on another thread of the reader during the first fraction of a
    millisecond of a Mooncake read delays the read by about as long as it runs, and by nothing once
    the copy runs; on a large host it delays nothing. So on a small host, beside a read large enough
    to be worth it, that work starts :data:`_BESIDE_AFTER_S` after the read is issued.
    """

    __slots__ = ("_hold", "_issued")

    def __init__(self, nbytes: int) -> None:
        self._issued = threading.Event()
        self._hold = nbytes >= _BESIDE_MIN_BYTES and usable_cpus() < _BESIDE_GATED_BELOW_CPUS

    def open(self) -> None:
        """The read is being issued (called right before it, on the reading thread)."""
        self._issued.set()

    def wait(self, deadline: float) -> None:
        """On the helper thread: return once the read has been under way for a moment (at once for
        a small read); never past ``deadline``."""
        if self._hold and self._issued.wait(max(0.0, deadline - time.monotonic())):
            time.sleep(_BESIDE_AFTER_S)


# How long a listing may stay the same while an object it names is gone before the rows count as lost
# (a clear changes the listing at once; only a dead store server leaves it as it was).
_LOST_AFTER_S = 2.0


@dataclass(frozen=True, slots=True)
class _Get:
    """What a get asked for."""

    partition_id: str
    part: _Part
    keys: Sequence[str]
    fields: Sequence[str]
    meta: KVBatchMeta | None
    deadline: float


class Gets(PartitionCache):
    """The get half of :class:`~dataplane.adapters.mooncake._store.MooncakeStore`."""

    def get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> Mapping[str, Column]:
        pending = self.begin_get(partition_id, keys, fields, meta=meta, timeout_s=timeout_s)
        cols = pending.plan(beside=False)
        again = pending.finish()
        if again is not None:
            return again
        assert cols is not None
        return cols

    def begin_get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> PendingGet:
        """Start a get: its ``plan`` makes the columns, its ``finish`` moves their bytes (see
        :class:`~dataplane.storage.PendingGet`).

        A get of exactly the rows of the meta's put (the usual RL read) needs only the meta's read
        hint (:data:`READ_KEY`) to start (:class:`_HintedGet`): it reads the put's objects into
        buffers taken here and then asks for the listing, while the meta's index is decoded and
        checked to name those objects. Planned beside, ``plan`` decodes on the client's helper
        thread and ``finish`` reads; in line, ``plan`` reads first, so the master answers while the
        columns are made and decoded. A put's objects never change and one removed before the read
        fails it, so reading before the check is safe. ``finish`` then takes the listing: what was
        read stands when that put's index is the partition's only one. When the store changed since
        that put, ``finish`` resolves afresh and keeps what it read if that put still holds the
        newest value of every row read (a later put of other fields, say), or reads again (new
        columns). Any other get lists, resolves and plans here (:class:`_ResolvedGet`); ``finish``
        reads, then asks whether the puts read are still there. Every read is trusted only once its
        put is still there after it (:meth:`_still_there`; a listing taken after the read shows that
        too).
        """
        deadline = time.monotonic() + timeout_s
        self.handle.check()  # closed or forked: fail before any I/O
        part = self._part(partition_id)
        early = self._read_hint(partition_id, keys, fields, meta)
        hints: dict[str, PutIndex] | None = None
        if early is None:
            hints = self._hints(partition_id, meta, part)
            hinted = self._whole_put(keys, fields, hints)
            if hinted is None:
                resolved = self._resolve(partition_id, part, keys, fields, hints, self._listing(deadline), deadline)
                return _ResolvedGet(self, _Get(partition_id, part, keys, fields, meta, deadline), hints, resolved)
            early = (hinted.key, *self._put_reads(hinted, fields))
        index_key, ops, landing = early
        return _HintedGet(self, _Get(partition_id, part, keys, fields, meta, deadline), hints, index_key, ops, landing)

    def _read_hint(
        self, partition_id: str, keys: Sequence[str], fields: Sequence[str], meta: KVBatchMeta | None
    ) -> tuple[str, list[ReadOp], Landing] | None:
        """The reads of a get of exactly the rows of the meta's put, from its read hint alone (no
        index decoded), and where they land; None when the hint is absent or does not fit the get.
        Only objects of this partition can be named; ``plan`` checks they are the put's."""
        hint = meta.extra_info.get(READ_KEY) if meta is not None else None
        if not isinstance(hint, (list, tuple)) or len(hint) != 7:
            return None
        index_key, n, first, last, sizes, packed, pad = hint
        if not (isinstance(index_key, str) and isinstance(sizes, Mapping) and n == len(keys) and n > 0):
            return None
        if keys[0] != first or keys[-1] != last or type(packed) is not int or not 0 <= packed <= _PACK_MAX_BYTES:
            return None
        if pad not in (1, OBJECT_ALIGN):
            return None
        want = [sizes.get(f) for f in fields]
        nbytes = [n for n in want if type(n) is int and n >= 0]
        if len(nbytes) != len(want) or sum(nbytes) > _EARLY_MAX_BYTES:
            return None  # a hint is only the meta's word: no allocation it could inflate beyond this
        prefix = index_prefix(self.ns, partition_id)
        parsed = parse_index_key(index_key, prefix) if index_key.startswith(prefix) else None
        if parsed is None:
            return None
        head = partition_prefix(self.ns, partition_id)
        if packed:  # the whole object; where each field lies in it comes from the index (plan)
            return index_key, *self.reader.packed_read(packed_key(head, parsed[0]), round_up(packed, pad))
        return index_key, *self.reader.whole_reads(
            {f: (data_key(head, parsed[0], f), n, round_up(n, pad)) for f, n in zip(fields, nbytes, strict=True)}
        )

    def _put_reads(self, put: PutIndex, fields: Sequence[str]) -> tuple[list[ReadOp], Landing]:
        """The reads of ``fields`` of every row of ``put`` (a packed put's one object, whole)."""
        if put.packed:
            return self.reader.packed_read(packed_key(put.head, put.put_id), put.stored(put.packed))
        return self.reader.whole_reads(
            {f: (put.data_key(f), put.fields[f].nbytes, put.stored(put.fields[f].nbytes)) for f in fields}
        )

    @staticmethod
    def _only_from(res: Resolved, p: PutIndex) -> bool:
        """Whether every row of ``res`` is row j of put ``p`` at position j (what a whole read of it got)."""
        if res.whole is not None:
            return res.whole.put_id == p.put_id
        if len(res.puts) != 1 or res.puts[0].put_id != p.put_id:
            return False
        return bool((res.rows == np.arange(len(res.rows))).all())

    @staticmethod
    def _names(hinted: PutIndex, fields: Sequence[str], ops: Sequence[ReadOp]) -> bool:
        """Whether ``ops`` read exactly the objects of ``fields`` in put ``hinted`` (a packed put's
        one object, whole)."""
        if hinted.packed:
            want = [(packed_key(hinted.head, hinted.put_id), hinted.stored(hinted.packed))]
        else:
            want = [
                (hinted.data_key(f), hinted.stored(hinted.fields[f].nbytes)) for f in fields if hinted.fields[f].nbytes
            ]
        return want == [(op.key, op.nbytes) for op in ops]

    @staticmethod
    def _whole_put(keys: Sequence[str], fields: Sequence[str], hints: Mapping[str, PutIndex]) -> PutIndex | None:
        """The meta's one put when the get asks for all of its rows in its order (the usual RL read)."""
        if len(hints) != 1:
            return None
        (p,) = hints.values()
        if p.op != "put" or tuple(keys) != p.keys or not all(f in p.fields for f in fields):
            return None
        return p

    def _only_put(self, partition_id: str, part: _Part, p: PutIndex, lines: Sequence[str]) -> bool:
        """Whether the rows of put ``p`` can be read without folding rows: the listing shows exactly one
        index in the partition, ``p``'s (no other write, no tombstone). The listing is the truth: any
        other put this cache still holds was cleared (usually by the writer, after the previous step's
        read) and is dropped. The put is kept in the cache unfolded; the next operation that needs the
        partition's state folds it (:meth:`_refresh`)."""
        prefix = index_prefix(self.ns, partition_id)
        if [ln for ln in lines if ln.startswith(prefix)] != [p.key]:
            return False
        with part.lock:
            if part.known.keys() - {p.put_id}:
                part.state = PartitionState()  # folded rows of cleared puts: rebuilt when next needed
            part.known = {p.put_id: p}
        return True

    def _resolve(
        self,
        partition_id: str,
        part: _Part,
        keys: Sequence[str],
        fields: Sequence[str],
        hints: Mapping[str, PutIndex],
        lines: list[str],
        deadline: float,
    ) -> dict[str, Resolved]:
        """Where every requested row lives according to ``lines``, or raises ``KeyNotFound``."""
        with part.lock:
            state = self._refresh(partition_id, part, lines, hints, deadline)
            missing_keys, missing_fields, resolved = state.resolve(keys, fields)
        if missing_keys or missing_fields:
            raise self._missing(partition_id, missing_keys, missing_fields, hints, lines)
        return resolved

    def _get_checked(
        self,
        partition_id: str,
        part: _Part,
        keys: Sequence[str],
        fields: Sequence[str],
        hints: Mapping[str, PutIndex],
        deadline: float,
        lines: list[str] | None = None,
        resolved: dict[str, Resolved] | None = None,
    ) -> Mapping[str, Column]:
        """List (unless given the listing ``lines``), resolve (unless given what ``lines`` resolve to),
        read, and keep what was read if every put it came from is still there after the read
        (:meth:`_still_there`); else again."""
        vanished_listing: list[str] | None = None  # the listing of the last read that found an object gone
        vanished_since = 0.0
        for attempt in itertools.count():
            if attempt:  # the puts read were removed under the read: rows rewritten and cleared meanwhile
                if time.monotonic() >= deadline:
                    raise DataPlaneTimeout(
                        f"partition {partition_id!r}: the puts holding these rows were removed while they "
                        f"were read, {attempt} times in a row until timeout_s; another process keeps "
                        "rewriting and clearing them (or a store server died). Raise timeout_s, or read "
                        "rows once their writers are done with them"
                    )
                if attempt >= 4:  # under heavy churn, let a burst of clears pass
                    time.sleep(min(0.05, 0.001 * 2 ** min(attempt - 4, 6)))
            if lines is None:
                lines = self._listing(deadline)
            if resolved is None:
                resolved = self._resolve(partition_id, part, keys, fields, hints, lines, deadline)
            try:
                cols = self.reader.read(resolved, deadline)
            except Vanished:
                # A clear removes a put's index with its data, so the next listing differs. The same
                # listing, read after read, still naming an object that is gone: its store server died.
                now = time.monotonic()
                if lines != vanished_listing:
                    vanished_listing, vanished_since = lines, now
                elif now - vanished_since >= _LOST_AFTER_S:
                    raise BackendUnavailable(
                        f"partition {partition_id!r}: rows of these keys are listed, but objects holding them "
                        f"have been gone for {now - vanished_since:.1f} s with no clear or rewrite meanwhile: the "
                        "store server that held them died (Mooncake keeps no other copy). Write the rows again"
                    ) from None
                lines = resolved = None
                continue
            if self._still_there(resolved, deadline):
                return cols
            lines = resolved = None
        raise AssertionError("unreachable")

    @staticmethod
    def _missing(
        partition_id: str,
        missing_keys: list[str],
        missing_fields: dict[str, list[str]],
        hints: Mapping[str, PutIndex],
        lines: Sequence[str],
    ) -> KeyNotFound:
        err = missing_rows_error(partition_id, missing_keys, missing_fields)
        listed = set(lines)
        gone = [key for key in hints if key not in listed]
        if not gone:
            return err
        return KeyNotFound(
            f"{err}. The put that returned this meta is no longer in the store: its rows were cleared, or "
            "the store server holding them died"
        )

    def _hints(self, partition_id: str, meta: KVBatchMeta | None, part: _Part) -> dict[str, PutIndex]:
        """Index objects a put returned in its meta (used only once a listing shows them)."""
        raw = meta.extra_info.get(HINT_KEY) if meta is not None else None
        if not isinstance(raw, Mapping):
            return {}
        prefix = index_prefix(self.ns, partition_id)
        out = {}
        for key, body in raw.items():
            parsed = parse_index_key(key, prefix) if isinstance(key, str) and key.startswith(prefix) else None
            if parsed is not None and isinstance(body, bytes) and len(body) == parsed[1]:
                known = part.known.get(parsed[0])  # names are unique and index objects immutable
                out[key] = known if known is not None and known.key == key else decode_index(key, parsed[0], body)
        return out


class _HintedGet(PendingGet):
    """A get of exactly the rows of the meta's put, read from the meta's read hint before its index is
    checked (see :meth:`Gets.begin_get`). ``plan`` and ``finish`` share what they found through this
    object; ``finish`` may run on another thread than ``plan``."""

    def __init__(
        self,
        store: Gets,
        get: _Get,
        hints: dict[str, PutIndex] | None,
        index_key: str,
        ops: list[ReadOp],
        landing: Landing,
    ) -> None:
        self._store = store
        self._get = get
        self._index_key = index_key
        self._ops = ops
        self._landing = landing
        self._gate = _Gate(sum(op.nbytes for op in ops))
        self._done = threading.Event()  # plan has ended
        self._hints = hints
        self._hinted: PutIndex | None = None  # the put read, once plan has checked the reads name its objects
        self._failed = False
        self._read = False  # whether the read was issued (by plan when it runs in line, else by finish)
        self._vanished = False  # a concurrent clear removed an object before it was read
        self._listing: Callable[[], list[str]] | None = None  # the listing asked for after the read

    def _read_objects(self) -> None:
        self._read = True
        self._gate.open()
        try:
            self._store.reader.run(self._ops, self._get.deadline, guessed=True)
        except Vanished:
            self._vanished = True
        self._listing = self._store._start_listing(self._get.deadline)  # asked for after the read: see _still_there

    def plan(self, *, beside: bool) -> Mapping[str, Column] | None:
        store, get = self._store, self._get
        try:
            if beside:  # on the client's helper thread, beside the read
                self._gate.wait(get.deadline)
            else:  # in line: the master answers while columns are made
                self._read_objects()
            if self._hints is None:
                self._hints = store._hints(get.partition_id, get.meta, get.part)
            p = store._whole_put(get.keys, get.fields, self._hints)
            if p is None or p.key != self._index_key or not store._names(p, get.fields, self._ops):
                return None  # the read hint does not describe the meta's put: finish reads afresh
            self._hinted = p
            return store.reader.columns_over(p, get.fields, self._landing)
        except BaseException:
            self._failed = True
            raise
        finally:
            self._done.set()

    def finish(self) -> Mapping[str, Column] | None:
        store, get = self._store, self._get
        if not self._read:  # plan runs beside, on the client's helper thread
            self._read_objects()
        if not self._done.wait(max(0.0, get.deadline - time.monotonic())):
            raise DataPlaneTimeout("planning a Mooncake get ran out of time; raise timeout_s")
        if self._failed:  # the client raises plan's error
            return None
        assert self._listing is not None
        lines = self._listing()
        hinted, hints = self._hinted, self._hints or {}
        args = (get.partition_id, get.part, get.keys, get.fields, hints, get.deadline)
        if hinted is None or self._vanished:
            return store._get_checked(*args, None if self._vanished else lines)
        if store._only_put(get.partition_id, get.part, hinted, lines):
            return None
        # Other puts or tombstones are listed: what was read stands if that put still holds the
        # newest value of every row read (a later put of other fields, say); else read again.
        # (A put no longer listed holds none: its bytes are not trusted either.)
        resolved = store._resolve(get.partition_id, get.part, get.keys, get.fields, hints, lines, get.deadline)
        if all(store._only_from(r, hinted) for r in resolved.values()):
            return None
        return store._get_checked(*args, lines, resolved)


class _ResolvedGet(PendingGet):
    """A get of anything but the rows of one put in its order: listed, resolved and planned when it
    began; ``finish`` reads, then asks whether the puts read are still there (see
    :meth:`Gets.begin_get`)."""

    def __init__(self, store: Gets, get: _Get, hints: dict[str, PutIndex], resolved: dict[str, Resolved]) -> None:
        self._store = store
        self._get = get
        self._hints = hints
        self._resolved = resolved
        self._columns, self._fill = store.reader.plan(resolved)
        self._gate = _Gate(sum(c.values.nbytes for c in self._columns.values()))

    def plan(self, *, beside: bool) -> Mapping[str, Column] | None:
        if beside:  # decoded beside the read, on the client's helper thread
            self._gate.wait(self._get.deadline)
        return self._columns

    def finish(self) -> Mapping[str, Column] | None:
        store, get = self._store, self._get
        check: list[Callable[[], bool]] = []
        self._gate.open()
        try:  # the check is asked once the reads are done; staged rows are gathered meanwhile
            self._fill(get.deadline, lambda: check.append(store._start_still_there(self._resolved, get.deadline)))
        except Vanished:  # a concurrent clear removed an object: resolve and read again
            return store._get_checked(get.partition_id, get.part, get.keys, get.fields, self._hints, get.deadline)
        if check[0]():
            return None
        return store._get_checked(get.partition_id, get.part, get.keys, get.fields, self._hints, get.deadline)
