"""How dataplane columns, schemas and row markers are laid out inside TransferQueue.

* **Data.** Every field travels in wire form, so TQ never pickles anything: a dense column as its
  ``[B, *inner]`` tensor; a jagged column as a jagged nested tensor built (zero-copy) from its
  ``values``/``offsets``; an object column as a jagged **uint8** nested tensor of its msgpack bytes.
  TQ hands dense fields back nested (and ``[B]`` as ``[B, (1)]`` on Mooncake); :func:`restore`
  rebuilds the exact shape from our schema with ``values().view(B, *inner)``, without a copy.
* **Schema.** One reserved key per (partition, field), ``__dataplane__/schema/<field>``, whose TQ
  tags hold the field's :class:`~dataplane.schema.FieldSchema`. It lives in the partition, so every
  process sees it and clearing the partition clears it. One key per field (not one per partition)
  because TQ's controller replaces a key's tags wholesale: writers adding different fields at the
  same time would otherwise lose each other's entries.
* **Row marker.** Every row written through dataplane carries the tag ``__dataplane__`` (its fields,
  sorted, comma-joined: field names cannot hold a comma, and one string is cheap in every TQ
  message that carries tags). A key without it is a row whose put has not committed (or failed): it is
  hidden from ``kv_list``, and a put treats it as new (so a rollback removes it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataplane.codec.jagged import offsets_from_lengths, to_nested
from dataplane.codec.wire import Column
from dataplane.errors import DataPlaneError, SchemaError
from dataplane.schema import FieldSchema

__all__ = [
    "MARKER",
    "assemble",
    "RESERVED_PREFIX",
    "SCHEMA_PREFIX",
    "decode_schemas",
    "is_reserved",
    "join_fields",
    "restore",
    "schema_key",
    "schema_tag",
    "signature_matches",
    "split_fields",
    "to_tq",
]

RESERVED_PREFIX = "__dataplane__"
SCHEMA_PREFIX = RESERVED_PREFIX + "/schema/"
MARKER = "__dataplane__"


def schema_key(field: str) -> str:
    return SCHEMA_PREFIX + field


def is_reserved(key: str) -> bool:
    return key.startswith(RESERVED_PREFIX)


def join_fields(fields: set[str]) -> str:
    return ",".join(sorted(fields))


def split_fields(marker: object) -> set[str]:
    return set(marker.split(",")) - {""} if isinstance(marker, str) else set()


def schema_tag(field: str, schema: FieldSchema) -> dict[str, Any]:
    return {"field": field, "schema": schema.to_dict()}


def decode_schemas(tags: Sequence[Mapping[str, Any]]) -> dict[str, FieldSchema]:
    """Schemas from the tags of schema keys (keys with no schema yet, i.e. uncommitted, are skipped)."""
    out: dict[str, FieldSchema] = {}
    for t in tags:
        field, raw = t.get("field"), t.get("schema")
        if isinstance(field, str) and isinstance(raw, Mapping):
            out[field] = FieldSchema.from_dict(raw)
    return out


def to_tq(col: Column) -> torch.Tensor:
    """The tensor TQ stores for a column (no copy)."""
    if col.offsets is None:
        return col.values
    return to_nested(col.values, col.offsets)


def signature_matches(schema: FieldSchema, tq_schema: Mapping[str, Any]) -> bool:
    """Whether TQ's own record of a field (dtype, nesting, row shape) agrees with ``schema``.

    Used to trust a schema carried in a meta's ``extra_info``. It cannot tell ``[B]`` from
    ``[B, 1]`` nor an object column from a jagged uint8 one, which is why a get by keys reads the
    schema from the store instead.
    """
    if tq_schema.get("dtype") != schema.dtype:
        return False
    nested = bool(tq_schema.get("is_nested"))
    if schema.kind != "dense":
        return nested
    if nested:
        return False
    shape = tuple(tq_schema.get("shape") or ())
    return shape == schema.inner_shape or (schema.inner_shape == () and shape == (1,))


def restore(field: str, schema: FieldSchema, value: Any, num_rows: int) -> Column:
    """Rebuild a column from what TQ returned for it (see the module docstring)."""
    if not isinstance(value, torch.Tensor):
        raise DataPlaneError(f"TransferQueue returned {type(value).__name__} for field {field!r}; expected a tensor")
    if value.dtype != schema.dtype:
        raise SchemaError(
            f"field {field!r} came back as {value.dtype} but its schema says {schema.describe()}; the partition "
            "was probably written by something other than dataplane"
        )
    if schema.kind == "dense":
        flat = value.values() if value.is_nested else value
        if flat.numel() != num_rows * schema.row_numel:
            raise DataPlaneError(
                f"field {field!r}: TransferQueue returned {flat.numel()} elements for {num_rows} rows of "
                f"{schema.describe()}"
            )
        shape = (num_rows, *schema.inner_shape)
        return Column(schema, flat.view(shape) if flat.is_contiguous() else flat.reshape(shape))
    if value.is_nested and value.layout == torch.jagged and getattr(value, "_ragged_idx", 1) == 1:
        values, offsets = value.values(), value.offsets()  # type: ignore[attr-defined]
        if int(offsets[0]) != 0 or value.size(0) != num_rows:
            rows = list(value.unbind())
            values, offsets = _cat_rows(rows, schema)
    else:  # strided nested, or dense when every row has the same length
        rows = list(value.unbind()) if value.is_nested else list(value.unbind(0))
        values, offsets = _cat_rows(rows, schema)
    if offsets.numel() != num_rows + 1 or tuple(values.shape[1:]) != schema.inner_shape:
        raise DataPlaneError(
            f"field {field!r}: TransferQueue returned rows of shape {tuple(values.shape[1:])} x "
            f"{offsets.numel() - 1}; expected {num_rows} rows of {schema.describe()}"
        )
    return Column(schema, values.contiguous(), offsets.to(torch.int64))


def _cat_rows(rows: list[torch.Tensor], schema: FieldSchema) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    if rows:
        values = torch.cat([r.reshape(r.shape[0], *schema.inner_shape) for r in rows])
    else:
        values = torch.empty((0, *schema.inner_shape), dtype=schema.dtype)
    return values, offsets_from_lengths(lengths)


def assemble(field: str, schema: FieldSchema, rows: list[Any]) -> Column:
    """A column from per-row tensors as SimpleStorage units return them (one copy)."""
    if any(not isinstance(r, torch.Tensor) or r.dtype != schema.dtype for r in rows):
        bad = next(r for r in rows if not isinstance(r, torch.Tensor) or r.dtype != schema.dtype)
        got = bad.dtype if isinstance(bad, torch.Tensor) else type(bad).__name__
        raise SchemaError(
            f"field {field!r}: a storage unit returned {got} where the schema says {schema.describe()}; the "
            "partition was probably written by something other than dataplane"
        )
    if schema.kind == "dense":
        shape = (len(rows), *schema.inner_shape)
        if any(tuple(r.shape) != schema.inner_shape for r in rows):
            raise DataPlaneError(f"field {field!r}: stored rows do not have the shape of {schema.describe()}")
        return Column(schema, torch.stack(rows) if rows else torch.empty(shape, dtype=schema.dtype))
    if any(r.dim() != 1 + len(schema.inner_shape) or tuple(r.shape[1:]) != schema.inner_shape for r in rows):
        raise DataPlaneError(f"field {field!r}: stored rows do not have the shape of {schema.describe()}")
    values, offsets = _cat_rows(rows, schema)
    return Column(schema, values, offsets)
