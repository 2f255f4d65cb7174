"""Fields in and out of the wire form: one :class:`Column` per field.

``encode_fields`` turns what a caller puts (a TensorDict, or a dict of tensors, nested tensors,
lists of row tensors and object columns) into columns, validating everything before any byte is
written. ``decode_columns`` turns columns read from a store into the TensorDict a caller gets.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from dataplane.codec.jagged import (
    PadValue,
    RaggedCache,
    is_jagged_nested,
    lengths_of,
    materialize,
    pack_nested,
    to_nested,
)
from dataplane.codec.objects import decode_objects, encode_objects, object_array_of, object_stack
from dataplane.errors import InvalidArgument, SchemaError
from dataplane.schema import FieldSchema, dtype_name, schema_of

__all__ = ["Column", "Layout", "decode_columns", "encode_fields", "tensordict_of", "validate_field_name"]

Layout = Literal["jagged", "padded"]
_FIELD_RE = re.compile(r"^[A-Za-z0-9_.:@+=/-]{1,200}$")
_VALID_NAMES: set[str] = set()  # names that passed, at most 4096


def validate_field_name(name: object) -> str:
    if type(name) is str and name in _VALID_NAMES:  # field names repeat on every call
        return name
    if not isinstance(name, str) or not _FIELD_RE.match(name):
        raise SchemaError(
            f"field name {name!r} is not allowed: use 1-200 characters from A-Z a-z 0-9 and _ . : @ + = / -"
        )
    if type(name) is str and len(_VALID_NAMES) < 4096:
        _VALID_NAMES.add(name)
    return name


@dataclass(frozen=True, slots=True)
class Column:
    """One field of a batch in wire form.

    Dense: ``values`` is ``[B, *inner]`` and ``offsets`` is None. Jagged and object: ``values`` is
    ``[sum(L), *inner]`` (uint8 bytes for objects) and ``offsets`` is int64 ``[B+1]``.
    """

    schema: FieldSchema
    values: torch.Tensor
    offsets: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.values.shape[0] if self.offsets is None else self.offsets.numel() - 1

    @property
    def nbytes(self) -> int:
        n = self.values.numel() * self.values.element_size()
        return n + (0 if self.offsets is None else self.offsets.numel() * 8)

    def lengths(self) -> torch.Tensor | None:
        return None if self.offsets is None else lengths_of(self.offsets)

    def rows(self) -> list[torch.Tensor]:
        """Per-row views of ``values`` (no copy)."""
        if self.offsets is None:
            return list(self.values.unbind(0))
        cuts = self.offsets.tolist()
        return [self.values[cuts[i] : cuts[i + 1]] for i in range(len(cuts) - 1)]


def _as_tensor_leaf(field: str, value: torch.Tensor) -> torch.Tensor:
    if value.layout is not torch.strided and not value.is_nested:
        raise SchemaError(f"field {field!r} is a {value.layout} tensor; store it dense (value.to_dense())")
    if value.is_meta:
        raise SchemaError(f"field {field!r} is a meta tensor, which holds no data; materialize it first")
    if value.requires_grad:
        value = value.detach()
    if not value.is_cpu:
        value = value.cpu()
    if value.is_conj() or value.is_neg():  # a lazy view: its memory holds other values than it means
        value = value.resolve_conj().resolve_neg()
    dtype_name(value.dtype)  # raises SchemaError for unsupported dtypes
    return value


def _column_from(
    field: str, value: Any, num_rows: int, pickle_fields: Collection[str], seen: dict[int, tuple[int, int]]
) -> Column:
    codec: Literal["msgpack", "pickle"] = "pickle" if field in pickle_fields else "msgpack"
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    elif isinstance(value, NonTensorData):
        objects = object_array_of(value)  # a TensorDict wraps a per-row object array as one value
        if objects is None:
            raise SchemaError(
                f"field {field!r} holds one value for the whole batch; per-row fields only -- "
                "put batch-level values in meta.extra_info"
            )
        value = objects
    elif isinstance(value, TensorDictBase):
        raise SchemaError(f"field {field!r} is a nested TensorDict; flatten it first (td.flatten_keys('.'))")
    if isinstance(value, np.ndarray):
        value = value.tolist() if value.dtype == object else torch.from_numpy(np.ascontiguousarray(value))
    if is_jagged_nested(value):  # before any tensor property: each is a __torch_function__ round on a nested tensor
        values, offsets = pack_nested(value, seen=seen)
        values, offsets = _as_tensor_leaf(field, values), (offsets if offsets.is_cpu else offsets.cpu())
        schema = schema_of("jagged", values.dtype, tuple(values.shape[1:]))
        col = Column(schema, values, offsets)
    elif isinstance(value, torch.Tensor):
        t = _as_tensor_leaf(field, value)
        if t.is_nested:
            values, offsets = pack_nested(t)
            schema = FieldSchema(kind="jagged", dtype=values.dtype, inner_shape=tuple(values.shape[1:]))
            col = Column(schema, values, offsets)
        else:
            if t.dim() == 0:
                raise SchemaError(f"field {field!r} is a 0-d tensor; per-row fields need a leading batch dim")
            schema = schema_of("dense", t.dtype, tuple(t.shape[1:]))
            col = Column(schema, t)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, torch.Tensor) for v in value):
            col = _column_from(
                field, torch.nested.as_nested_tensor(list(value), layout=torch.jagged), num_rows, (), seen
            )
        else:
            values, offsets = encode_objects(field, value, codec)
            col = Column(FieldSchema(kind="object", dtype=torch.uint8, codec=codec), values, offsets)
    else:
        raise SchemaError(
            f"field {field!r} has unsupported type {type(value).__name__}; use a tensor, a nested tensor, "
            "a list of row tensors, or a list / numpy object array of Python objects"
        )
    if col.num_rows != num_rows:
        raise InvalidArgument(f"field {field!r} has {col.num_rows} rows but {num_rows} keys were given")
    return col


def encode_fields(
    fields: TensorDictBase | Mapping[str, Any],
    num_rows: int,
    *,
    pickle_fields: Collection[str] = (),
) -> dict[str, Column]:
    """Validate and convert every field; raises before anything is written."""
    if isinstance(fields, TensorDictBase):
        if fields.batch_dims < 1 or fields.batch_size[0] != num_rows:
            raise InvalidArgument(
                f"TensorDict batch_size {list(fields.batch_size)} does not match {num_rows} keys; "
                "its first batch dim must equal len(keys)"
            )
        items: Sequence[tuple[Any, Any]] = [(k, fields.get(k)) for k in fields.keys()]
    elif isinstance(fields, Mapping):
        items = list(fields.items())
    else:
        raise SchemaError(f"fields must be a TensorDict or a dict, got {type(fields).__name__}")
    if not items:
        raise InvalidArgument("fields is empty; give at least one field to write")
    seen: dict[int, tuple[int, int]] = {}  # offsets tensors shared by several fields are read once
    return {validate_field_name(k): _column_from(k, v, num_rows, pickle_fields, seen) for k, v in items}


def _pad_value_for(field: str, pad_values: PadValue | Mapping[str, PadValue] | None) -> PadValue:
    if pad_values is None:
        return 0
    if isinstance(pad_values, Mapping):
        return pad_values.get(field, 0)
    return pad_values


def decode_columns(
    columns: Mapping[str, Column],
    num_rows: int,
    *,
    layout: Layout = "jagged",
    pad_values: PadValue | Mapping[str, PadValue] | None = None,
    pad_to_multiple: int = 1,
    pad_to_length: int | None = None,
    pickle_fields: Collection[str] = (),
) -> TensorDict:
    """Columns -> TensorDict with batch size ``[num_rows]``.

    Jagged fields come back as jagged nested tensors (``layout="jagged"``) or right-padded with their
    pad value (``layout="padded"``); object fields as an :class:`~dataplane.codec.objects.ObjectStack`
    of the decoded objects (``td[field]`` is a plain list).
    """
    if layout not in ("jagged", "padded"):
        raise InvalidArgument(f"layout must be 'jagged' or 'padded', got {layout!r}")
    out: dict[str, Any] = {}
    ragged = RaggedCache()  # fields with equal row lengths share offsets (and one ragged dim)
    for field, col in columns.items():
        kind = col.schema.kind
        if kind == "dense":
            out[field] = col.values
            continue
        assert col.offsets is not None
        if kind == "object":
            assert col.schema.codec is not None
            objs = decode_objects(field, col.values, col.offsets, col.schema.codec, allow_pickle=field in pickle_fields)
            out[field] = object_stack(objs, num_rows)
        elif layout == "padded":
            out[field] = materialize(
                col.values,
                col.offsets,
                pad_value=_pad_value_for(field, pad_values),
                pad_to_multiple=pad_to_multiple,
                pad_to_length=pad_to_length,
                ragged=ragged(col.offsets),
            )
        else:
            out[field] = to_nested(col.values, col.offsets, ragged=ragged(col.offsets))
    return tensordict_of(out, num_rows)


def tensordict_of(items: dict[str, Any], num_rows: int) -> TensorDict:
    """A TensorDict of ``items``, whose leading dims are already known to be ``num_rows``.

    The public constructor re-checks every leaf's batch dim (~12 us a nested tensor, so 0.4 ms for
    32 fields); the values here come from our own decoding, whose row counts the client checked.
    """
    new_unsafe = getattr(TensorDict, "_new_unsafe", None)
    if new_unsafe is None:  # pragma: no cover - other tensordict versions
        return TensorDict(items, batch_size=[num_rows])
    td = new_unsafe(items, batch_size=torch.Size([num_rows]), nested=False)
    assert isinstance(td, TensorDict)
    return td
