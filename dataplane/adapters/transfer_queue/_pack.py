"""SimpleStorage layout: the fields of one put travel as one TQ field, a *pack*, one blob per row.

TransferQueue's SimpleStorage keeps, sends and decodes every (row, field) as its own tensor, and
each costs it tens of microseconds whatever its size: a 256-row get of 32 fields is 8192 tensors
and takes four times as long as the same bytes in one field. Packed, it is 256 tensors.

* **Pack.** The fields of one put, sorted by name, are the pack ``"a,b,c"``. Its TQ field is
  ``__dataplane__/pack/<hash of the name>`` (short, and one per distinct field set, so TQ's
  controller keeps a few columns per partition, not one per put).
* **Row blob.** A header of ``int64[F]`` byte sizes of the row's piece of each field,
  ``int32[F]`` counts (a jagged field's length, 1 for a dense one, bytes for an object),
  ``int32[F]`` schema tokens (a hash of each field's :class:`~dataplane.schema.FieldSchema`, so a
  reader checks the schema it decodes with against the one the bytes were written with) and an
  ``int64`` hash of the row's key (TransferQueue gives a cleared row's index to the next new key,
  and a reader that took the index before a clear and reads after such a put finds another key's
  blob: it checks, and reads again); then the pieces in pack order. A dense field's piece is its ``[*inner]`` row, a jagged field's its ``[L_i, *inner]``
  rows, an object field's its msgpack bytes.
* **Row marker.** The row tag ``__dataplane__`` lists the row's packs in write order,
  ``"a,b,c;b"``: a field is read from the last pack that holds it. A put of a pack moves it to the
  end and drops packs left with no field of their own. A pack's superseded bytes stay on the row
  until the row is cleared (TQ clears rows, not fields).

The put copies every byte once into a staging buffer, the get once per field out of TQ's frames;
both buffers come from :func:`dataplane._host.bufpool.default_pool` (a fresh one would pay a page fault
per 4 KiB, which costs more than the copy).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataplane._host.bufpool import default_pool
from dataplane.adapters.transfer_queue._layout import RowsChanged
from dataplane.codec.jagged import offsets_from_lengths, to_nested
from dataplane.codec.wire import Column
from dataplane.errors import DataPlaneError, SchemaError
from dataplane.schema import FieldSchema

__all__ = [
    "PACK_PREFIX",
    "Packed",
    "StaleSchema",
    "column_of",
    "key_stamps",
    "marker_after_put",
    "pack_columns",
    "pack_field",
    "pack_fields",
    "pack_name",
    "packs_of_marker",
    "parse_pack",
]

PACK_PREFIX = "__dataplane__/pack/"
_CORRUPT = "the partition was probably written by something other than dataplane"


class StaleSchema(DataPlaneError):
    """A row's bytes were written with another schema than the one the reader decodes with."""


def pack_name(fields: Sequence[str]) -> str:
    return ",".join(sorted(fields))


@functools.lru_cache(maxsize=4096)
def pack_fields(pack: str) -> tuple[str, ...]:
    return tuple(pack.split(","))


@functools.lru_cache(maxsize=4096)
def pack_field(pack: str) -> str:
    """TQ field name of a pack."""
    return PACK_PREFIX + hashlib.blake2b(pack.encode(), digest_size=10).hexdigest()


@functools.lru_cache(maxsize=4096)
def schema_token(schema: FieldSchema) -> int:
    digest = hashlib.blake2b(repr(sorted(schema.to_dict().items())).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little", signed=True)


@functools.lru_cache(maxsize=4096)
def packs_of_marker(marker: str) -> dict[str, str]:
    """``"a,b,c;b"`` -> ``{"a": "a,b,c", "c": "a,b,c", "b": "b"}`` (later packs win)."""
    out: dict[str, str] = {}
    for pack in marker.split(";"):
        if pack:
            out.update(dict.fromkeys(pack_fields(pack), pack))
    return out


@functools.lru_cache(maxsize=4096)
def marker_after_put(marker: str | None, pack: str) -> str:
    """The row marker once ``pack`` is written: ``pack`` last, packs it left empty dropped."""
    written = set(pack_fields(pack))
    kept: list[str] = []
    live: set[str] = set(written)
    for old in reversed((marker or "").split(";")):
        if old and old != pack:
            own = set(pack_fields(old)) - live
            if own:
                kept.append(old)
                live |= own
    return ";".join([*reversed(kept), pack])


def _byte_view(values: torch.Tensor) -> torch.Tensor:
    flat = values.reshape(-1)
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


@dataclass(frozen=True, slots=True)
class Packed:
    pack: str
    rows: torch.Tensor  # jagged uint8 nested tensor, one blob per row


def key_stamps(keys: Sequence[str]) -> np.ndarray:
    """The ``int64`` hash of each key a row blob carries."""
    return np.array(
        [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little", signed=True) for k in keys],
        dtype=np.int64,
    )


def pack_columns(columns: Mapping[str, Column], num_rows: int, *, keys: Sequence[str]) -> Packed:
    """One blob per row holding every column's piece of that row and its key's stamp (one copy,
    into a pooled buffer: it goes back to the pool when TQ has sent it and the last view is gone)."""
    pack = pack_name(list(columns))
    fields = pack_fields(pack)
    nf = len(fields)
    sizes = np.empty((num_rows, nf), dtype=np.int64)
    counts = np.ones((num_rows, nf), dtype=np.int32)
    tokens = np.empty((num_rows, nf), dtype=np.int32)
    starts = np.empty((num_rows, nf), dtype=np.int64)
    sources = []
    for j, f in enumerate(fields):
        col = columns[f]
        unit = col.schema.row_nbytes
        tokens[:, j] = schema_token(col.schema)
        sources.append(_byte_view(col.values).numpy())
        if col.offsets is None:
            sizes[:, j] = unit
            starts[:, j] = np.arange(num_rows, dtype=np.int64) * unit
        else:
            offsets = col.offsets.numpy()
            counts[:, j] = np.diff(offsets)
            sizes[:, j] = counts[:, j].astype(np.int64) * unit
            starts[:, j] = offsets[:-1] * unit
    stamps = key_stamps(keys).reshape(num_rows, 1)
    head = np.concatenate(
        [sizes.view(np.uint8), counts.view(np.uint8), tokens.view(np.uint8), stamps.view(np.uint8)], axis=1
    )
    blob = sizes.sum(1) + head.shape[1]
    offsets_out = offsets_from_lengths(torch.from_numpy(blob))
    total = int(offsets_out[-1])
    ends = (starts + sizes).tolist()
    pieces: list[np.ndarray] = []
    for h, row_starts, row_ends in zip(head, starts.tolist(), ends, strict=True):
        pieces.append(h)
        pieces.extend(src[a:b] for src, a, b in zip(sources, row_starts, row_ends, strict=True))
    out = default_pool().empty(total)
    np.concatenate(pieces, out=out.numpy())
    return Packed(pack, to_nested(out, offsets_out))


@dataclass(slots=True)
class ParsedPack:
    """The blobs of one pack for some rows of a get, with where each field's piece lies in them."""

    fields: tuple[str, ...]
    positions: list[int]  # batch position of each blob
    blobs: list[np.ndarray]
    starts: np.ndarray  # [n, F] int64: byte offset of each piece in its blob
    sizes: np.ndarray  # [n, F] int64 bytes
    counts: np.ndarray  # [n, F] int32 rows of each piece
    tokens: np.ndarray  # [n, F] int32


def parse_pack(pack: str, blobs: Sequence[object], positions: list[int], *, keys: Sequence[str]) -> ParsedPack:
    """The blobs of ``pack`` read for the get's rows at ``positions`` (of the get's ``keys``);
    raises :class:`RowsChanged` when one is another key's (its index was handed on meanwhile)."""
    fields = pack_fields(pack)
    nf = len(fields)
    head_bytes = 16 * nf + 8
    for b in blobs:
        if not isinstance(b, torch.Tensor) or b.dtype is not torch.uint8 or b.dim() != 1 or b.numel() < head_bytes:
            got = f"{b.dtype}{list(b.shape)}" if isinstance(b, torch.Tensor) else type(b).__name__
            raise DataPlaneError(f"a TransferQueue row of pack {pack!r} holds {got}, not a dataplane blob; {_CORRUPT}")
    arrays = [b.numpy() for b in blobs]  # type: ignore[attr-defined]
    head = np.stack([a[:head_bytes] for a in arrays])
    sizes = head[:, : 8 * nf].copy().view(np.int64)
    meta = head[:, 8 * nf : 16 * nf].copy().view(np.int32)
    counts, tokens = meta[:, :nf], meta[:, nf:]
    stamps = head[:, 16 * nf :].copy().view(np.int64).reshape(-1)
    if not np.array_equal(stamps, key_stamps([keys[p] for p in positions])):
        raise RowsChanged(f"rows of pack {pack!r} hold other keys' blobs: their indexes were handed on while read")
    ends = np.cumsum(sizes, axis=1) + head_bytes
    if (sizes < 0).any() or not np.array_equal(ends[:, -1], [a.size for a in arrays]):
        raise DataPlaneError(f"a TransferQueue row of pack {pack!r} does not add up to its header; {_CORRUPT}")
    return ParsedPack(fields, positions, arrays, ends - sizes, sizes, counts, tokens)


def column_of(field: str, schema: FieldSchema, num_rows: int, sources: Sequence[ParsedPack]) -> Column:
    """Field ``field`` of ``num_rows`` rows from the packs that hold it (together, every row once)."""
    unit = schema.row_nbytes
    token = schema_token(schema)
    pieces: list[np.ndarray | None] = [None] * num_rows
    counts = np.empty(num_rows, dtype=np.int64)
    for src in sources:
        j = src.fields.index(field)
        _check(field, schema, unit, src, j, token)
        counts[src.positions] = src.counts[:, j]
        cut = zip(src.blobs, src.starts[:, j].tolist(), (src.starts[:, j] + src.sizes[:, j]).tolist(), strict=True)
        for pos, (blob, a, b) in zip(src.positions, cut, strict=True):
            pieces[pos] = blob[a:b]
    if any(p is None for p in pieces):  # pragma: no cover - the caller groups every row
        raise DataPlaneError(f"field {field!r}: some rows were not read; this is a dataplane bug")
    offsets = offsets_from_lengths(torch.from_numpy(counts))  # counts were checked >= 0
    total = int(offsets[-1])  # rows of the values tensor (num_rows for a dense field)
    out = default_pool().empty(total * unit)
    np.concatenate(pieces, out=out.numpy())  # type: ignore[arg-type]
    values = schema.view_rows(out, total)
    if schema.kind == "dense":
        return Column(schema, values)
    return Column(schema, values, offsets)


def _check(field: str, schema: FieldSchema, unit: int, src: ParsedPack, j: int, token: int) -> None:
    if not (src.tokens[:, j] == token).all():
        raise StaleSchema(f"field {field!r} was written with another schema than {schema.describe()}")
    counts = src.counts[:, j]
    ok = (counts == 1).all() if schema.kind == "dense" else (counts >= 0).all()
    if not (ok and (src.sizes[:, j] == counts.astype(np.int64) * unit).all()):
        raise SchemaError(f"field {field!r}: stored rows do not have the size of {schema.describe()}; {_CORRUPT}")
