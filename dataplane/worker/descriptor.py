"""What the leader of a replica group broadcasts: a small descriptor plus one flat buffer per dtype.

The leader reads its shard in jagged wire form (``values`` + ``offsets`` per ragged field, dense
fields as ``[B, *inner]``, object columns as msgpack bytes) and coalesces every field's buffers into
one flat tensor per dtype (offsets go into the int64 one). The descriptor says where each field
lives in those buffers, so every rank can cut the same views out of what it received and
materialize locally; padding never crosses the wire. The descriptor has an error slot: a leader
whose read fails sends the error instead of buffers, and every rank raises it.

>>> import torch
>>> from dataplane.codec.wire import encode_fields
>>> cols = encode_fields({"ids": [torch.tensor([1, 2]), torch.tensor([3])]}, 2)
>>> desc = plan_buffers(cols, rows=2, digest="d")
>>> Descriptor.from_bytes(desc.to_bytes()) == desc
True
>>> views = unstage(desc, stage(cols, desc, torch.device("cpu")))
>>> views["ids"].values.tolist(), views["ids"].offsets.tolist()
([1, 2, 3], [0, 2, 3])
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from dataplane import errors as _errors
from dataplane.codec.jagged import pack_nested
from dataplane.codec.objects import encode_objects
from dataplane.codec.wire import Column
from dataplane.errors import DataPlaneError, SchemaError
from dataplane.meta import KVBatchMeta
from dataplane.schema import FieldKind, FieldSchema, ObjectCodecName, dtype_from_name, dtype_name

__all__ = [
    "PROTOCOL_VERSION",
    "Descriptor",
    "ErrorInfo",
    "FieldEntry",
    "batch_digest",
    "columns_from_jagged",
    "error_from_info",
    "objects_column",
    "plan_buffers",
    "stage",
    "unstage",
]

PROTOCOL_VERSION = 1
_OFFSETS_DTYPE = "int64"


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorInfo:
    """The leader's failure, as it travels: exception class name, message, leader's global rank."""

    type: str
    message: str
    rank: int

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int) -> ErrorInfo:
        return cls(type=type(exc).__name__, message=str(exc), rank=rank)


def error_from_info(info: ErrorInfo, *, context: str | None = None) -> DataPlaneError:
    """The typed error every rank raises for a leader failure.

    The class is the dataplane error of the same name; anything else becomes a plain
    :class:`DataPlaneError` whose message starts with the original class name. ``context`` is
    appended to the message: None says the replica group's leader raised it, ``""`` adds nothing
    (for a message that already says where it comes from).

    >>> err = error_from_info(ErrorInfo(type="KeyNotFound", message="1 key(s) missing", rank=2))
    >>> type(err).__name__, isinstance(err, KeyError)
    ('KeyNotFound', True)
    >>> str(error_from_info(ErrorInfo(type="ValueError", message="bad", rank=0), context=""))
    'ValueError: bad'
    """
    where = (
        f" [raised by the replica group's leader (global rank {info.rank}) while reading the shard; "
        "every rank of the group raises it]"
        if context is None
        else context
    )
    cls = getattr(_errors, info.type, None)
    if isinstance(cls, type) and issubclass(cls, DataPlaneError):
        return cls(info.message + where)
    return DataPlaneError(f"{info.type}: {info.message}{where}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldEntry:
    """Where one field lives in the flat buffers.

    Attributes:
        name: field name.
        kind: ``dense``, ``jagged`` or ``object``.
        dtype: element dtype name of ``values`` (``uint8`` for objects).
        shape: full shape of ``values`` (``[B, *inner]`` dense, ``[sum(L), *inner]`` jagged, ``[nbytes]`` object).
        codec: object codec (``msgpack`` or ``pickle``), else None.
        buffer: index of the buffer holding ``values``.
        start: element offset of ``values`` in that buffer.
        offsets_start: element offset of the ``B+1`` offsets in the int64 buffer (None for dense).
    """

    name: str
    kind: FieldKind
    dtype: str
    shape: tuple[int, ...]
    codec: ObjectCodecName | None
    buffer: int
    start: int
    offsets_start: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class Descriptor:
    """The one message a leader broadcasts before any buffer.

    Attributes:
        version: protocol version (a mismatch fails every rank, never hangs one).
        rows: number of rows of the shard.
        digest: :func:`batch_digest` of what the leader read; siblings check their own against it.
        fields: where each field lives, in ``select_fields`` order.
        buffers: ``(dtype name, numel)`` of each flat buffer, in broadcast order.
        error: set instead of fields and buffers when the leader's read failed.
    """

    version: int = PROTOCOL_VERSION
    rows: int
    digest: str
    fields: tuple[FieldEntry, ...] = ()
    buffers: tuple[tuple[str, int], ...] = ()
    error: ErrorInfo | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of all flat buffers."""
        return sum(n * torch.empty((), dtype=dtype_from_name(d)).element_size() for d, n in self.buffers)

    def to_bytes(self) -> bytes:
        doc = {
            "v": self.version,
            "rows": self.rows,
            "digest": self.digest,
            "fields": [
                [f.name, f.kind, f.dtype, list(f.shape), f.codec, f.buffer, f.start, f.offsets_start]
                for f in self.fields
            ],
            "buffers": [[d, n] for d, n in self.buffers],
            "error": None if self.error is None else [self.error.type, self.error.message, self.error.rank],
        }
        out = msgpack.packb(doc, use_bin_type=True)
        assert isinstance(out, bytes)
        return out

    @classmethod
    def from_bytes(cls, data: bytes) -> Descriptor:
        doc = msgpack.unpackb(data, raw=False)
        if not isinstance(doc, dict) or doc.get("v") != PROTOCOL_VERSION:
            got = doc.get("v") if isinstance(doc, dict) else type(doc).__name__
            raise DataPlaneError(
                f"replica-group descriptor has protocol version {got!r}, this rank speaks {PROTOCOL_VERSION}; "
                "install the same dataplane version on every rank"
            )
        err = doc["error"]
        return cls(
            version=doc["v"],
            rows=int(doc["rows"]),
            digest=str(doc["digest"]),
            fields=tuple(
                FieldEntry(
                    name=n,
                    kind=k,
                    dtype=d,
                    shape=tuple(int(x) for x in s),
                    codec=c,
                    buffer=int(b),
                    start=int(st),
                    offsets_start=None if o is None else int(o),
                )
                for n, k, d, s, c, b, st, o in doc["fields"]
            ),
            buffers=tuple((str(d), int(n)) for d, n in doc["buffers"]),
            error=None if err is None else ErrorInfo(type=str(err[0]), message=str(err[1]), rank=int(err[2])),
        )


def batch_digest(meta: KVBatchMeta, fields: Sequence[str]) -> str:
    """A short hash of (partition, keys, fields): every rank of a group must fetch the same rows.

    >>> m = KVBatchMeta(partition_id="p", keys=["a", "b"])
    >>> batch_digest(m, ["x"]) == batch_digest(m, ["x"]) != batch_digest(m, ["y"])
    True
    """
    packed = msgpack.packb([meta.partition_id, list(meta.keys), list(fields)], use_bin_type=True)
    return hashlib.blake2b(packed, digest_size=12).hexdigest()


def objects_column(field: str, rows: list[Any]) -> Column:
    """Per-row objects in wire form: msgpack, or pickle where only pickle can hold them."""
    codec: ObjectCodecName = "msgpack"
    try:
        values, offsets = encode_objects(field, rows, "msgpack")
    except SchemaError:
        # Only reachable for fields the client was told to read with pickle: the bytes go to
        # siblings of the same job, which trust the leader as much as its own process.
        codec = "pickle"
        values, offsets = encode_objects(field, rows, "pickle")
    return Column(FieldSchema(kind="object", dtype=torch.uint8, codec=codec), values, offsets)


def columns_from_jagged(data: TensorDictBase, fields: Sequence[str]) -> dict[str, Column]:
    """The wire form of a ``layout="jagged"`` read: no copy for tensors, msgpack bytes for objects.

    >>> import dataplane
    >>> c = dataplane.connect()
    >>> m = c.kv_batch_put(["a"], {"t": [torch.arange(3)], "o": ["hi"]}, partition_id="p")
    >>> cols = columns_from_jagged(c.kv_batch_get(m, select_fields=["t", "o"]), ["t", "o"])
    >>> cols["t"].schema.kind, cols["o"].schema.codec
    ('jagged', 'msgpack')
    """
    out: dict[str, Column] = {}
    for name in fields:
        value = data.get(name)
        if isinstance(value, NonTensorStack):
            out[name] = objects_column(name, value.tolist())
        elif isinstance(value, NonTensorData):
            out[name] = objects_column(name, [value.data] * int(data.batch_size[0]))
        elif isinstance(value, torch.Tensor) and value.is_nested:
            values, offsets = pack_nested(value)
            schema = FieldSchema(kind="jagged", dtype=values.dtype, inner_shape=tuple(values.shape[1:]))
            out[name] = Column(schema, values, offsets)
        elif isinstance(value, torch.Tensor):
            out[name] = Column(FieldSchema(kind="dense", dtype=value.dtype, inner_shape=tuple(value.shape[1:])), value)
        else:
            raise SchemaError(f"field {name!r} came back as {type(value).__name__}; the client broke its contract")
    return out


def plan_buffers(columns: Mapping[str, Column], *, rows: int, digest: str) -> Descriptor:
    """Lay every field out in one flat buffer per dtype (offsets in the int64 buffer)."""
    order: list[str] = []
    sizes: dict[str, int] = {}

    def take(dtype: str, numel: int) -> tuple[int, int]:
        if dtype not in sizes:
            order.append(dtype)
            sizes[dtype] = 0
        start = sizes[dtype]
        sizes[dtype] += numel
        return order.index(dtype), start

    entries = []
    for name, col in columns.items():
        dtype = dtype_name(col.values.dtype)
        buffer, start = take(dtype, col.values.numel())
        offsets_start = None
        if col.offsets is not None:
            _, offsets_start = take(_OFFSETS_DTYPE, col.offsets.numel())
        entries.append(
            FieldEntry(
                name=name,
                kind=col.schema.kind,
                dtype=dtype,
                shape=tuple(col.values.shape),
                codec=col.schema.codec,
                buffer=buffer,
                start=start,
                offsets_start=offsets_start,
            )
        )
    return Descriptor(rows=rows, digest=digest, fields=tuple(entries), buffers=tuple((d, sizes[d]) for d in order))


def allocate(desc: Descriptor, device: torch.device) -> list[torch.Tensor]:
    """Empty flat buffers for ``desc`` on ``device`` (what a sibling receives into)."""
    return [torch.empty(n, dtype=dtype_from_name(d), device=device) for d, n in desc.buffers]


def stage(columns: Mapping[str, Column], desc: Descriptor, device: torch.device) -> list[torch.Tensor]:
    """Copy every field into its slot of freshly allocated flat buffers on ``device`` (one copy each)."""
    buffers = allocate(desc, device)
    i64 = _offsets_buffer(desc, buffers)
    for entry in desc.fields:
        col = columns[entry.name]
        if entry.numel:
            buffers[entry.buffer][entry.start : entry.start + entry.numel].copy_(col.values.reshape(-1))
        if col.offsets is not None:
            assert i64 is not None and entry.offsets_start is not None
            i64[entry.offsets_start : entry.offsets_start + col.offsets.numel()].copy_(col.offsets)
    return buffers


def _offsets_buffer(desc: Descriptor, buffers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    for i, (d, _) in enumerate(desc.buffers):
        if d == _OFFSETS_DTYPE:
            return buffers[i]
    return None


def unstage(desc: Descriptor, buffers: Sequence[torch.Tensor]) -> dict[str, Column]:
    """Views of each field in the received buffers (object bytes are moved to the CPU to decode)."""
    if len(buffers) != len(desc.buffers):
        raise DataPlaneError(f"got {len(buffers)} buffers for a descriptor of {len(desc.buffers)}; this is a bug")
    i64 = _offsets_buffer(desc, buffers)
    out: dict[str, Column] = {}
    for entry in desc.fields:
        values = buffers[entry.buffer][entry.start : entry.start + entry.numel].view(entry.shape)
        offsets = None
        if entry.offsets_start is not None:
            assert i64 is not None
            offsets = i64[entry.offsets_start : entry.offsets_start + desc.rows + 1]
        dtype = dtype_from_name(entry.dtype)
        if entry.kind == "object":
            assert offsets is not None
            values, offsets = values.cpu(), offsets.cpu()
            schema = FieldSchema(kind="object", dtype=dtype, codec=entry.codec)
        else:
            schema = FieldSchema(kind=entry.kind, dtype=dtype, inner_shape=entry.shape[1:])
        out[entry.name] = Column(schema, values, offsets)
    return out


def wire_bytes(columns: Mapping[str, Column]) -> int:
    """Bytes of the wire form of ``columns`` (values plus offsets)."""
    return sum(col.nbytes for col in columns.values())
