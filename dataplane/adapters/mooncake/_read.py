"""Reading resolved rows out of Mooncake: plan the reads of a get, issue them, gather locally.

For each requested field the rows come from one or more data objects (one per put). The rows of one
put, in its order, are one whole-object read straight into the result buffer (zero copy). Otherwise
each object is read either as ranges (runs of rows merged where they are contiguous in the object
and in the result) straight into the result, or whole into a staging buffer and gathered locally,
whichever the cost model says is cheaper. A packed put (every field in one small object) is read
whole once per get, whatever fields it serves: the result views it where it is the only source of
a field's rows, else its rows are gathered from it.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataplane._host.bufpool import BufferPool
from dataplane._host.hostcopy import copy_spans
from dataplane.adapters.mooncake._fold import Resolved
from dataplane.adapters.mooncake._handle import NOT_FOUND, NOT_READY, TRANSIENT, StoreHandle, error_for
from dataplane.adapters.mooncake._index import OBJECT_ALIGN, PACK_ALIGN, PutIndex, data_keys, packed_key
from dataplane.codec.jagged import round_up
from dataplane.codec.wire import Column
from dataplane.schema import FieldSchema

__all__ = ["Landing", "ReadOp", "Reader", "Vanished"]

_ATTEMPTS = 8
_SHORT = -10_001  # our code for a read that returned another number of bytes than asked for
_INVALID = -600  # Mooncake's INVALID_PARAMS, e.g. for a buffer smaller than the object

# Cost model of one read over TCP or RDMA (a shared-memory client reads whole objects only): each
# contiguous piece costs a fixed time whatever its size, bytes then move at the network's rate, and
# a local gather copy at memory speed. The best constants depend on the machine (python -m
# benchmarks.mooncake_layout measures a host's); these are a middle ground between small and large hosts.
_PIECE_S = 150e-6
_NET_BPS = 1.2e9
_COPY_BPS = 8e9


class Vanished(Exception):
    """A listed object was removed before it was read (a concurrent clear): resolve again."""


@dataclass
class ReadOp:
    """Read ``key``: whole (``ranges`` None) into ``ptr``, or the ranges (dst, src, size) into ``ptr``."""

    key: str
    ptr: int
    nbytes: int
    ranges: list[tuple[int, int, int]] | None = None


@dataclass
class Landing:
    """Where whole-object reads land: large fields in one slab (at their offsets), small ones in
    buffers of their own; or a packed put's one object (``packed``), whose fields lie where its index
    says."""

    slab: torch.Tensor | None
    at: dict[str, int]
    own: dict[str, torch.Tensor]
    packed: torch.Tensor | None = None

    def buffer(self, field: str, nbytes: int, at: int = 0) -> torch.Tensor | None:
        """The bytes of ``field`` (``at``: where they start in a packed object)."""
        if self.packed is not None:
            return self.packed[at : at + nbytes] if nbytes and at + nbytes <= self.packed.numel() else None
        if field in self.at:
            assert self.slab is not None
            return self.slab[self.at[field] : self.at[field] + nbytes]
        own = self.own.get(field)
        return None if own is None else own[:nbytes]  # (it has room for the object's padding)


# :func:`copy_spans` from staged objects: the result buffer, the objects, and per run which object
# it is in (None: the only one), where it lands in the result, where it is in its object, its size
_Gather = tuple[torch.Tensor, list[torch.Tensor], np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]
_NO_RUNS = np.zeros(0, dtype=np.int64)


@dataclass(eq=False)
class _Spans:
    """Where a get's rows of one field are, in leading-dim units (rows of a dense field, elements of
    a jagged one), as runs merged where they are contiguous both in the result and in their object,
    sorted by put: fields resolved alike over the same offsets share it, and scale it by their own
    bytes per unit. Vectorized over rows and over puts: a data-parallel rank's share of a batch has
    one span per row, and rows streamed in one at a time come from thousands of puts."""

    total: int
    offsets: torch.Tensor | None  # of the result (jagged and object fields)
    put: np.ndarray  # per run: the index of its put in ``Resolved.puts``
    lands: np.ndarray  # per run: where it lands in the result
    starts: np.ndarray  # per run: where it starts in its object
    sizes: np.ndarray  # per run
    bounds: np.ndarray  # the runs of put k are runs[bounds[k] : bounds[k + 1]]

    @classmethod
    def of(cls, res: Resolved, offs: Sequence[np.ndarray | None], jagged: bool) -> _Spans:
        """The spans of the rows of ``res`` of a field whose offsets in each put are ``offs``."""
        which, rows = res.which, res.rows
        n, k = len(rows), len(res.puts)
        if all(o is None for o in offs):  # dense: a row is one unit
            first, every = rows, np.ones(n, dtype=np.int64)
        else:
            if k == 1:
                at, cat = rows, offs[0]
            else:  # every put's offsets back to back: one lookup for all rows
                full = [np.arange(len(p.keys) + 1) if o is None else o for p, o in zip(res.puts, offs, strict=True)]
                base = np.zeros(k, dtype=np.int64)
                np.cumsum([len(o) for o in full[:-1]], out=base[1:])
                at, cat = base[which] + rows, np.concatenate(full)
            assert cat is not None
            first = cat[at]
            every = cat[at + 1] - first
        lands = np.cumsum(every) - every
        total = int(lands[-1] + every[-1]) if n else 0
        out = None
        if jagged:
            out = torch.zeros(n + 1, dtype=torch.int64)
            torch.cumsum(torch.from_numpy(every), 0, out=out[1:])
        if k == 1:
            w, d, s, m = np.zeros(n, dtype=np.int64), lands, first, every
        else:  # by put; rows of one put keep their order in the result
            order = np.argsort(which, kind="stable")
            w, d, s, m = which[order], lands[order], first[order], every[order]
        keep = m > 0
        if not keep.all():
            w, d, s, m = w[keep], d[keep], s[keep], m[keep]
        if not len(m):
            return cls(total, out, _NO_RUNS, _NO_RUNS, _NO_RUNS, _NO_RUNS, np.zeros(k + 1, dtype=np.int64))
        # merge runs of one put that are contiguous both where they land and in the object
        cut = np.flatnonzero((w[1:] != w[:-1]) | (d[1:] != d[:-1] + m[:-1]) | (s[1:] != s[:-1] + m[:-1])) + 1
        head = np.concatenate((np.zeros(1, dtype=np.int64), cut))
        put = w[head]
        bounds = np.searchsorted(put, np.arange(k + 1))
        return cls(total, out, put, d[head], s[head], np.add.reduceat(m, head), bounds)


@dataclass
class _Stage:
    """Where a get's packed puts are read whole: put id -> offset in ``buf``, and the reads."""

    buf: torch.Tensor | None
    at: dict[str, int]
    ops: list[ReadOp]


def _runs_in(
    buf: torch.Tensor, where: np.ndarray, put: np.ndarray, lands: np.ndarray, starts: np.ndarray, sizes: np.ndarray
) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
    """The runs (``put``, ``lands``, ``starts``, ``sizes``: per run, as in :class:`_Spans`, in bytes) of
    the puts whose bytes of the field lie in ``buf``, from ``where[k]`` on for put k (-1: not there),
    as a source of the gather: (buf, where each lands, where it starts in buf, its size)."""
    mine = where[put] >= 0
    return buf, lands[mine], starts[mine] + where[put[mine]], sizes[mine]


def _empty(schema: FieldSchema, rows: int) -> torch.Tensor:
    return torch.empty((rows, *schema.inner_shape), dtype=schema.dtype)


class Reader:
    """Turns a resolution (field -> where each row lives) into columns, through ``handle``."""

    def __init__(self, handle: StoreHandle, pool: BufferPool) -> None:
        self.handle = handle
        self.pool = pool

    def read(self, resolved: Mapping[str, Resolved], deadline: float) -> dict[str, Column]:
        """The columns, or raises a typed error (``Vanished`` when an object disappeared)."""
        out, fill = self.plan(resolved)
        fill(deadline, None)
        return out

    def plan(
        self, resolved: Mapping[str, Resolved]
    ) -> tuple[dict[str, Column], Callable[[float, Callable[[], None] | None], None]]:
        """The columns, whose buffers are empty until the returned ``fill(deadline, read)`` has run
        (``read``, if given, is called once the reads are done, before staged rows are gathered)."""
        whole = {f: r.whole for f, r in resolved.items() if r.whole is not None}
        by_put: dict[str, list[str]] = {}
        for f, p in whole.items():
            by_put.setdefault(p.put_id, []).append(f)
        ops, landing = self.whole_reads(
            {
                f: (p.data_key(f), p.fields[f].nbytes, p.stored(p.fields[f].nbytes))
                for f, p in whole.items()
                if not p.packed
            }
        )
        cols: dict[str, Column] = {}
        for fs in by_put.values():
            if not whole[fs[0]].packed:
                cols.update(self.columns_over(whole[fs[0]], fs, landing))
        gathers: list[_Gather] = []
        seen: list[tuple[Resolved, list[np.ndarray | None], _Spans]] = []
        planned: list[tuple[str, Resolved, _Spans]] = []
        for field, res in resolved.items():
            if field in cols or (res.whole is not None and res.whole.packed):
                continue
            offs = [p.fields[field].offsets for p in res.puts]
            # fields resolved alike (the same row arrays) over the same offsets arrays share spans
            field_spans = next(
                (
                    sp
                    for r, o, sp in seen
                    if r.rows is res.rows and r.which is res.which and all(map(operator.is_, o, offs))
                ),
                None,
            )
            if field_spans is None:
                field_spans = _Spans.of(res, offs, res.schema.kind != "dense")
                seen.append((res, offs, field_spans))
            planned.append((field, res, field_spans))
        # every packed put is read once, into one buffer, whatever fields it serves: Mooncake fills only
        # the last buffer of a key named twice in one batch read (and reports both as read)
        stage = self._stage_packed([p for f, p in whole.items() if p.packed], planned)
        ops += stage.ops
        for fs in by_put.values():
            p = whole[fs[0]]
            if p.packed:  # its columns view the staged object
                assert stage.buf is not None
                at = stage.at[p.put_id]
                cols.update(self.columns_over(p, fs, Landing(None, {}, {}, stage.buf[at : at + p.packed])))
        for field, res, field_spans in planned:
            cols[field], field_ops, field_gathers = self._plan_field(field, res, field_spans, stage)
            ops += field_ops
            gathers += field_gathers
        out = {field: cols[field] for field in resolved}

        def fill(deadline: float, read: Callable[[], None] | None = None) -> None:
            self.run(ops, deadline)
            if read is not None:
                read()
            for gather in gathers:
                copy_spans(*gather)

        return out, fill

    def packed_read(self, key: str, stored: int) -> tuple[list[ReadOp], Landing]:
        """The whole-object read of packed put object ``key`` (``stored`` bytes, padding included) and
        where it lands."""
        buf = self.pool.empty(stored)
        return [ReadOp(key, buf.data_ptr(), stored)], Landing(None, {}, {}, buf)

    def _stage_packed(self, whole: Sequence[PutIndex], planned: Sequence[tuple[str, Resolved, _Spans]]) -> _Stage:
        """One whole read per packed put: those of ``whole`` and those any of ``planned`` has rows of,
        all into one buffer."""
        at: dict[str, int] = {}  # put id -> where its object lands (insertion order: the reads')
        keys: list[str] = []
        sizes: list[int] = []
        end = 0
        needed = list(whole)
        distinct = {(id(res.puts), id(spans)): (res.puts, spans) for _, res, spans in planned}  # fields resolved alike
        for puts, spans in distinct.values():
            needed += [puts[k] for k in np.flatnonzero(np.diff(spans.bounds)).tolist()]
        for p in needed:  # every packed put of ``whole``, and of the puts ``planned`` has rows of
            if p.packed and p.put_id not in at:
                at[p.put_id] = end
                keys.append(packed_key(p.head, p.put_id))
                sizes.append(p.stored(p.packed))
                end += round_up(sizes[-1], OBJECT_ALIGN if p.pad > 1 else PACK_ALIGN)
        if not keys:
            return _Stage(None, at, [])
        buf = self.pool.empty(end)
        base = buf.data_ptr()
        return _Stage(buf, at, [ReadOp(k, base + a, n) for k, a, n in zip(keys, at.values(), sizes, strict=True)])

    def whole_reads(self, objects: Mapping[str, tuple[str, int, int]]) -> tuple[list[ReadOp], Landing]:
        """Whole-object reads of ``objects`` (field -> (key, bytes, bytes stored: its padding
        included)) and where they land: buffers taken here, those of 1 MiB or more in one pooled slab,
        each on a page (a field of 0 bytes has no object)."""
        slab, at = self.pool.slab({f: stored for f, (_, _, stored) in objects.items()}, align=OBJECT_ALIGN)
        base = 0 if slab is None else slab.data_ptr()
        own: dict[str, torch.Tensor] = {}
        ops: list[ReadOp] = []
        for field, (key, n, stored) in objects.items():
            if not n:
                continue
            if field in at:
                ptr = base + at[field]
            else:
                buf = own[field] = self.pool.empty(stored)
                ptr = buf.data_ptr()
            ops.append(ReadOp(key, ptr, stored))
        return ops, Landing(slab, at, own)

    @staticmethod
    def columns_over(put: PutIndex, fields: Sequence[str], landing: Landing) -> dict[str, Column]:
        """The columns of ``fields`` of every row of ``put``, in its order, over the buffers of
        ``landing`` (see :meth:`whole_reads`); fields sharing one offsets array share one tensor."""
        out: dict[str, Column] = {}
        shared: dict[int, torch.Tensor] = {}
        n = len(put.keys)
        for field in fields:
            entry = put.fields[field]
            schema, offsets = entry.schema, None
            if entry.offsets is not None:
                offsets = shared.get(id(entry.offsets))
                if offsets is None:
                    offsets = shared[id(entry.offsets)] = torch.from_numpy(entry.offsets.copy())
            rows = n if entry.offsets is None else int(entry.offsets[-1])
            buf = landing.buffer(field, entry.nbytes, entry.at)
            values = _empty(schema, rows) if buf is None else schema.view_rows(buf, rows)
            out[field] = Column(schema, values, offsets)
        return out

    def _plan_field(
        self, field: str, res: Resolved, spans: _Spans, stage: _Stage
    ) -> tuple[Column, list[ReadOp], list[_Gather]]:
        """Rows from several puts, or not in their put's order: ranged or staged reads (the rows of
        packed puts from ``stage``)."""
        schema, unit = res.schema, res.schema.row_nbytes
        total = spans.total * unit
        buf = self.pool.empty(total)
        base = buf.data_ptr()
        d_all, s_all, m_all = spans.lands * unit, spans.starts * unit, spans.sizes * unit
        puts = res.puts
        nbytes = np.array([p.fields[field].nbytes for p in puts], dtype=np.int64)
        stored = np.array([p.stored(int(n)) for p, n in zip(puts, nbytes.tolist(), strict=True)], dtype=np.int64)
        lo, counts = spans.bounds[:-1], np.diff(spans.bounds)
        staged: list[tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]] = []
        if stage.at:  # rows of packed puts: gathered from where their objects were staged
            at = stage.at  # a packed put none of whose rows here has bytes was not staged: no runs
            shift = np.array(
                [at[p.put_id] + p.fields[field].at if p.put_id in at else -1 for p in puts], dtype=np.int64
            )
            packed = shift >= 0
            if packed[spans.put].any():
                assert stage.buf is not None
                staged.append(_runs_in(stage.buf, shift, spans.put, d_all, s_all, m_all))
            counts = np.where(packed, 0, counts)
        # a put whose one run is its whole object (rows put one at a time), unpadded: read in place
        one = np.flatnonzero(counts == 1)
        whole = one[(s_all[lo[one]] == 0) & (m_all[lo[one]] == nbytes[one]) & (stored[one] == nbytes[one])]
        keys = data_keys([puts[k] for k in whole.tolist()], field)
        ops = [
            ReadOp(key, base + d, n)
            for key, d, n in zip(keys, d_all[lo[whole]].tolist(), nbytes[whole].tolist(), strict=True)
        ]
        rest = np.flatnonzero(counts > 0)
        if len(whole):
            rest = np.setdiff1d(rest, whole, assume_unique=True)
        can_range = bool(len(rest)) and self.handle.covers(base, total)  # ranges land in registered memory only
        bulk = rest  # read whole into one staging buffer, then gathered
        if can_range:
            whole_ks = []
            for k in rest.tolist():
                a, b = int(spans.bounds[k]), int(spans.bounds[k + 1])
                d, src, m = d_all[a:b], s_all[a:b], m_all[a:b]
                size, need = int(nbytes[k]), int(m.sum())
                ranged_s = len(m) * _PIECE_S + need / _NET_BPS
                whole_s = _PIECE_S + size / _NET_BPS + need / _COPY_BPS
                if ranged_s <= whole_s:
                    key = puts[k].data_key(field)
                    ops.append(ReadOp(key, base, size, list(zip(d.tolist(), src.tolist(), m.tolist(), strict=True))))
                else:
                    whole_ks.append(k)
            bulk = np.array(whole_ks, dtype=np.int64)
        if len(bulk):  # each on a page of the buffer where every object is padded to pages
            rooms = stored[bulk]
            step = OBJECT_ALIGN if not (rooms % OBJECT_ALIGN).any() else PACK_ALIGN
            slots = -(-rooms // step) * step
            lands = np.cumsum(slots) - slots
            into = self.pool.empty(int(slots.sum()))
            first = into.data_ptr()
            keys = data_keys([puts[k] for k in bulk.tolist()], field)
            ops += [ReadOp(key, first + o, r) for key, o, r in zip(keys, lands.tolist(), rooms.tolist(), strict=True)]
            landed = np.full(len(puts), -1, dtype=np.int64)  # where each put's object lands in ``into``
            landed[bulk] = lands
            staged.append(_runs_in(into, landed, spans.put, d_all, s_all, m_all))
        gathers: list[_Gather] = []
        if staged:  # one gather from every staged object: their rows may alternate row by row
            which = np.repeat(np.arange(len(staged)), [len(m) for *_, m in staged]) if len(staged) > 1 else None
            runs = [np.concatenate([x[k] for x in staged]) for k in (1, 2, 3)]
            gathers.append((buf, [x[0] for x in staged], which, runs[0], runs[1], runs[2]))
        rows = len(res.rows) if spans.offsets is None else spans.total
        values = schema.view_rows(buf, rows) if total else _empty(schema, rows)
        return Column(schema, values, spans.offsets), ops, gathers

    def run(self, ops: list[ReadOp], deadline: float, *, guessed: bool = False) -> None:
        """Issue the reads (one call, or one per 1024 keys); retry what Mooncake may recover from.
        ``guessed``: the sizes are a read hint's word, so an object of another size (a short read, or
        Mooncake's -600 for a buffer too small) means the hint is wrong: :class:`Vanished`."""
        if not ops:
            return
        for attempt in range(_ATTEMPTS):
            codes = self._issue(ops)
            bad = [c for c in codes if c < 0]
            if not bad:
                return
            if NOT_FOUND in bad or (guessed and (_SHORT in bad or _INVALID in bad)):
                raise Vanished
            retryable = all(c in TRANSIENT or c in (NOT_READY, _SHORT) for c in bad)
            if retryable and attempt + 1 < _ATTEMPTS and time.monotonic() < deadline:
                time.sleep(0.02 * 2 ** min(attempt, 4))
                continue
            raise error_for(-800 if bad[0] == _SHORT else bad[0], f"reading {len(ops)} data objects")

    def _issue(self, ops: list[ReadOp]) -> list[int]:
        """A code per read (per range of a ranged one): 0, negative for a failure, :data:`_SHORT` for
        a read of another size."""
        codes: list[int] = []
        if all(op.ranges is None for op in ops):
            got = self.handle.get_into([o.key for o in ops], [o.ptr for o in ops], [o.nbytes for o in ops])
            for op, c in zip(ops, got, strict=True):
                codes.append(c if c < 0 else (0 if c == op.nbytes else _SHORT))
            return codes
        # get_into_ranges writes only into registered memory (else -600 INVALID_PARAMS): a whole read
        # into other memory (a small field's buffer, under the pool's minimum) goes by get_into
        direct = [op.ranges is None and not self.handle.covers(op.ptr, op.nbytes) for op in ops]
        if any(direct):
            codes = self._issue([op for op, d in zip(ops, direct, strict=True) if d])
        ranged = [op for op, d in zip(ops, direct, strict=True) if not d]
        reads = [(op.ptr, op.key, op.ranges if op.ranges is not None else [(0, 0, op.nbytes)]) for op in ranged]
        for (_, _, rngs), res in zip(reads, self.handle.get_ranges(reads), strict=True):
            for (_, _, m), c in zip(rngs, res, strict=True):
                codes.append(c if c < 0 else (0 if c == m else _SHORT))
        return codes
