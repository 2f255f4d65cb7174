"""Reading resolved rows out of Mooncake: plan the reads of a get, issue them, gather locally.

For each requested field the rows come from one or more data objects (one per put). The rows of one
put, in its order, are one whole-object read straight into the result buffer (zero copy). Otherwise
each object is read either as ranges (runs of rows merged where they are contiguous in the object
and in the result) straight into the result, or whole into a staging buffer and gathered locally,
whichever the cost model says is cheaper.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from dataplane.adapters._mc_handle import NOT_FOUND, NOT_READY, TRANSIENT, StoreHandle, error_for
from dataplane.adapters._mc_index import PutIndex, Resolved
from dataplane.bufpool import BufferPool
from dataplane.codec.wire import Column
from dataplane.schema import FieldSchema

__all__ = ["Reader", "Vanished"]

_ATTEMPTS = 8

# Cost model of one read, measured cross-process on loopback TCP (scratch/mooncake_layout/NOTES.md):
# each contiguous piece costs ~0.1-0.2 ms whatever its size, bytes then move at ~1-2 GB/s, and a
# local gather copy runs at ~10 GB/s.
_PIECE_S = 150e-6
_NET_BPS = 1.2e9
_COPY_BPS = 8e9


class Vanished(Exception):
    """A listed object was removed before it was read (a concurrent clear): resolve again."""


@dataclass
class _Op:
    """Read ``key``: whole (``ranges`` None) into ``ptr``, or the ranges (dst, src, size) into ``ptr``."""

    key: str
    ptr: int
    nbytes: int
    ranges: list[tuple[int, int, int]] | None = None


_Gather = tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]  # (dst, staged object, runs)


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
        fill(deadline)
        return out

    def plan(self, resolved: Mapping[str, Resolved]) -> tuple[dict[str, Column], Callable[[float], None]]:
        """The columns, whose buffers are empty until the returned ``fill(deadline)`` has run."""
        out: dict[str, Column] = {}
        ops: list[_Op] = []
        gathers: list[_Gather] = []
        offsets: dict[int, torch.Tensor] = {}  # one tensor per shared offsets array (one ragged dim)
        # whole-object reads of 1 MiB or more land in one pooled (registered) buffer
        slices = self.pool.carve({f: r.whole.fields[f].nbytes for f, r in resolved.items() if r.whole is not None})
        for field, res in resolved.items():
            col, field_ops, field_gathers = self._plan_field(field, res, offsets, slices.get(field))
            out[field] = col
            ops += field_ops
            gathers += field_gathers

        def fill(deadline: float) -> None:
            self._run(ops, deadline)
            for dst, stage, runs in gathers:
                for d, src, n in runs:
                    dst[d : d + n] = stage[src : src + n]

        return out, fill

    def _plan_field(
        self, field: str, res: Resolved, shared: dict[int, torch.Tensor], dst: torch.Tensor | None
    ) -> tuple[Column, list[_Op], list[_Gather]]:
        schema, locs = res.schema, res.locs
        if res.whole is not None:  # the rows of one put, in order: one read straight into the result
            first = res.whole
            n = len(first.keys)
            entry0 = first.fields[field]
            total = entry0.nbytes
            offsets = None
            if entry0.offsets is not None:
                offsets = shared.get(id(entry0.offsets))
                if offsets is None:
                    offsets = shared[id(entry0.offsets)] = torch.from_numpy(entry0.offsets.copy())
            rows = n if entry0.offsets is None else int(entry0.offsets[-1])
            if not total:
                return Column(schema, _empty(schema, rows), offsets), [], []
            buf = dst if dst is not None else self.pool.empty(total)
            values = schema.view_rows(buf, rows)
            return Column(schema, values, offsets), [_Op(first.data_key(field), buf.data_ptr(), total)], []
        n = len(locs)
        runs: dict[str, list[tuple[int, int, int]]] = {}  # put_id -> [(dst, src, size)]
        puts: dict[str, PutIndex] = {}
        lengths: list[int] = []
        total = 0
        for p, i in locs:
            entry = p.fields[field]
            src, size = entry.span(i)
            if entry.offsets is not None:
                lengths.append(entry.length(i))
            if size:
                prs = runs.setdefault(p.put_id, [])
                puts[p.put_id] = p
                if prs and prs[-1][0] + prs[-1][2] == total and prs[-1][1] + prs[-1][2] == src:
                    d, s, m = prs[-1]
                    prs[-1] = (d, s, m + size)
                else:
                    prs.append((total, src, size))
            total += size
        offsets = None
        if schema.kind != "dense":
            offsets = torch.zeros(n + 1, dtype=torch.int64)
            if n:
                torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
        buf = self.pool.empty(total)
        base = buf.data_ptr()
        can_range = self.handle.covers(base, total)  # get_into_ranges reads only into registered memory
        ops: list[_Op] = []
        gathers: list[_Gather] = []
        for pid, prs in runs.items():
            p = puts[pid]
            key, nbytes = p.data_key(field), p.fields[field].nbytes
            if len(prs) == 1 and prs[0][1] == 0 and prs[0][2] == nbytes:  # whole object, in place
                ops.append(_Op(key, base + prs[0][0], nbytes))
                continue
            need = sum(m for _, _, m in prs)
            ranged_s = len(prs) * _PIECE_S + need / _NET_BPS
            whole_s = _PIECE_S + nbytes / _NET_BPS + need / _COPY_BPS
            if can_range and ranged_s <= whole_s:
                ops.append(_Op(key, base, nbytes, prs))
            else:
                stage = self.pool.empty(nbytes)
                ops.append(_Op(key, stage.data_ptr(), nbytes))
                gathers.append((buf.numpy(), stage.numpy(), prs))
        rows = n if offsets is None else int(offsets[-1])
        values = schema.view_rows(buf, rows) if total else _empty(schema, rows)
        return Column(schema, values, offsets), ops, gathers

    def _run(self, ops: list[_Op], deadline: float) -> None:
        """Issue the reads (one call, or one per 1024 keys); retry what Mooncake may recover from."""
        if not ops:
            return
        for attempt in range(_ATTEMPTS):
            codes = self._issue(ops)
            bad = [c for c in codes if c < 0]
            if not bad:
                return
            if NOT_FOUND in bad:
                raise Vanished
            retryable = all(c in TRANSIENT or c == NOT_READY for c in bad)
            if retryable and attempt + 1 < _ATTEMPTS and time.monotonic() < deadline:
                time.sleep(0.02 * 2 ** min(attempt, 4))
                continue
            raise error_for(bad[0], f"reading {len(ops)} data objects")

    def _issue(self, ops: list[_Op]) -> list[int]:
        """Negative codes of the failed reads (or short-read sentinels)."""
        codes: list[int] = []
        if all(op.ranges is None for op in ops):
            got = self.handle.get_into([o.key for o in ops], [o.ptr for o in ops], [o.nbytes for o in ops])
            for op, c in zip(ops, got, strict=True):
                codes.append(c if c < 0 else (0 if c == op.nbytes else -800))
            return codes
        reads = [(op.ptr, op.key, op.ranges if op.ranges is not None else [(0, 0, op.nbytes)]) for op in ops]
        for (_, _, rngs), res in zip(reads, self.handle.get_ranges(reads), strict=True):
            for (_, _, m), c in zip(rngs, res, strict=True):
                codes.append(c if c < 0 else (0 if c == m else -800))
        return codes
