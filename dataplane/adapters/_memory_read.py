"""What a ``memory://`` get reads and how its bytes leave the store: into memory the get allocates
(:func:`assemble`, for ``get``) or, window by window, into the caller's buffers
(:class:`WindowedMemoryRead`, for ``begin_read_into``: :mod:`dataplane.adapters.read_into`).

Either way the bytes are copied once, outside the store's lock: a stored buffer is never written
after its put publishes it, and a :class:`Read` holds the chunks it reads alive even if a concurrent
put or clear drops them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataplane._host.bufpool import default_pool
from dataplane._host.hostcopy import copy_spans, merge_spans
from dataplane.codec.jagged import offsets_from_lengths
from dataplane.codec.wire import Column
from dataplane.errors import InvalidArgument
from dataplane.schema import FieldSchema

__all__ = ["Chunk", "Read", "WindowedMemoryRead", "as_bytes", "assemble"]


class Chunk:
    """One put's copy of one column; its bytes count until its last row is gone."""

    __slots__ = ("buf", "live", "nbytes", "offsets")

    def __init__(self, buf: torch.Tensor, offsets: torch.Tensor | None) -> None:
        self.buf = buf  # dense: [B, *inner]; jagged/object: [sum(L), *inner]
        self.offsets = offsets  # jagged/object: row i is buf[offsets[i]:offsets[i + 1]]
        self.nbytes = buf.numel() * buf.element_size()
        self.live = buf.shape[0] if offsets is None else offsets.numel() - 1


@dataclass(frozen=True, slots=True, eq=False)
class Read:
    """One field's rows of a get: the chunks they come from, which chunk each row is in (None: all
    in the first), and where each row starts in its chunk and its length (leading-dim units)."""

    chunks: list[Chunk]
    which: np.ndarray | None
    starts: np.ndarray
    lengths: np.ndarray


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _offsets(
    schema: FieldSchema, lengths: np.ndarray, ragged: list[tuple[np.ndarray, torch.Tensor]]
) -> torch.Tensor | None:
    """A jagged or object field's offsets; jagged fields whose rows have the same lengths share one
    offsets tensor, hence one ragged dim."""
    if schema.kind == "dense":
        return None
    offsets = None
    if schema.kind == "jagged":
        offsets = next((o for lens, o in ragged if np.array_equal(lens, lengths)), None)
    if offsets is None:
        offsets = offsets_from_lengths(torch.from_numpy(lengths))
        if schema.kind == "jagged":
            ragged.append((lengths, offsets))
    return offsets


def assemble(schemas: Mapping[str, FieldSchema], reads: Mapping[str, Read], fields: Sequence[str]) -> dict[str, Column]:
    """Copy each field's rows back to back into memory the caller owns (:func:`copy_spans`: one
    vectorized gather, whichever puts the rows alternate between): fields of 1 MiB or more share one
    pooled buffer (:meth:`BufferPool.carve`), smaller ones get their own."""
    units = {f: int(reads[f].lengths.sum()) for f in fields}
    nbytes = {f: units[f] * schemas[f].row_nbytes for f in fields}
    carved = default_pool().carve(nbytes)
    ragged: list[tuple[np.ndarray, torch.Tensor]] = []
    out: dict[str, Column] = {}
    for f in fields:
        schema, read = schemas[f], reads[f]
        unit = schema.row_nbytes
        raw = carved.get(f)
        if raw is None:
            raw = torch.empty(nbytes[f], dtype=torch.uint8)
        if nbytes[f]:
            sizes = read.lengths * unit
            srcs = [as_bytes(c.buf) for c in read.chunks]
            copy_spans(raw, srcs, read.which, np.cumsum(sizes) - sizes, read.starts * unit, sizes)
        out[f] = Column(schema, schema.view_rows(raw, units[f]), _offsets(schema, read.lengths, ragged))
    return out


@dataclass(frozen=True, slots=True, eq=False)
class _Spans:
    """A field's bytes as spans of its sources, landing back to back: per span which source (None:
    all in the first), where it lands in the field's values and where it starts in its source (bytes),
    its size. Empty spans are dropped and neighbours contiguous in both are merged, so the rows of
    one put in its order are one span."""

    srcs: list[torch.Tensor]
    which: np.ndarray | None
    lands: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    ends: np.ndarray  # lands + sizes
    total: int

    @classmethod
    def of(cls, read: Read, unit: int) -> _Spans:
        sizes = read.lengths * unit
        lands = np.cumsum(sizes) - sizes
        total = int(sizes.sum())
        which, lands, starts, sizes = merge_spans(read.which, lands, read.starts * unit, sizes)
        srcs = [as_bytes(c.buf) for c in read.chunks]
        return cls(srcs, which, lands, starts, sizes, lands + sizes, total)


class WindowedMemoryRead:
    """``memory://``'s :class:`~dataplane.adapters.read_into.WindowedRead`: the planned get's reads,
    any byte window of a field copied on demand (one :func:`copy_spans` gather per window)."""

    device_direct = False

    def __init__(self, schemas: Mapping[str, FieldSchema], reads: Mapping[str, Read], fields: Sequence[str]) -> None:
        ragged: list[tuple[np.ndarray, torch.Tensor]] = []
        cols: dict[str, Column] = {}
        self._spans: dict[str, _Spans] = {}
        for f in fields:
            schema, read = schemas[f], reads[f]
            units = int(read.lengths.sum())
            values = torch.empty((units, *schema.inner_shape), dtype=schema.dtype, device="meta")
            cols[f] = Column(schema, values, _offsets(schema, read.lengths, ragged))
            self._spans[f] = _Spans.of(read, schema.row_nbytes)
        self.columns: Mapping[str, Column] = cols

    def read_into(self, field: str, start: int, dst: torch.Tensor) -> None:
        spans = self._spans.get(field)
        if spans is None:
            raise InvalidArgument(f"field {field!r} is not part of this read; it reads {sorted(self._spans)}")
        if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous() or dst.device.type != "cpu":
            raise InvalidArgument(
                f"read_into writes a contiguous 1-d uint8 host tensor, got {dst.dtype} {tuple(dst.shape)} on "
                f"{dst.device}; pass a byte view of host memory"
            )
        end = start + dst.numel()
        if start < 0 or end > spans.total:
            raise InvalidArgument(
                f"bytes {start}..{end} of field {field!r} are outside its {spans.total} bytes; read a window inside them"
            )
        lo = int(np.searchsorted(spans.ends, start, side="right"))  # the first span ending after start
        hi = int(np.searchsorted(spans.lands, end, side="left"))  # the first span starting at or after end
        if lo >= hi:
            return
        lands, starts, sizes = spans.lands[lo:hi], spans.starts[lo:hi], spans.sizes[lo:hi]
        cut = np.maximum(start - lands, 0)  # what the window cuts off the first span
        lands = lands + cut
        sizes = np.minimum(lands - cut + sizes, end) - lands  # ... and off the last
        which = None if spans.which is None else spans.which[lo:hi]
        copy_spans(dst, spans.srcs, which, lands - start, starts + cut, sizes)
