"""How dataplane columns, schemas and row markers are laid out inside TransferQueue.

* **Data.** Every field travels in wire form, so TQ never pickles anything. On SimpleStorage the
  fields of one put travel together as one packed TQ field, one uint8 blob per row
  (:mod:`dataplane.adapters.transfer_queue._pack`). On Mooncake each field is its own TQ field: a dense column
  as its ``[B, *inner]`` tensor, a jagged column as a jagged nested tensor built (zero-copy) from
  its ``values``/``offsets``, an object column as a jagged **uint8** nested tensor of its msgpack
  bytes (:mod:`dataplane.adapters.transfer_queue._mooncake_backend` moves the bytes).
* **Schema.** One reserved key per (partition, field), ``__dataplane__/schema/<field>``, whose TQ
  tags hold the field's :class:`~dataplane.schema.FieldSchema`. It lives in the partition, so every
  process sees it and clearing the partition clears it. One key per field (not one per partition)
  because TQ's controller replaces a key's tags wholesale: writers adding different fields at the
  same time would otherwise lose each other's entries.
* **Keys.** A row's TQ key is the user's key as it is (any key the core accepts). One beginning
  with ``__dataplane__`` is stored with a NUL in front (:func:`stored_keys`), which no user key
  holds, so it never meets a reserved key; listings take the NUL off again.
* **Row marker.** Every row written through dataplane carries the tag ``__dataplane__``: on
  Mooncake its fields, sorted, comma-joined; on SimpleStorage its packs, ``;``-joined, each a
  comma-joined field list (field names hold neither, and one string is cheap in every TQ message
  that carries tags). An empty marker is a row holding no field (a tag-only put made it). A key
  without it is a row whose put has not committed (or failed): it is hidden from ``kv_list`` and
  ``kv_describe``, and a put treats it as new (so a rollback removes it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataplane.codec.jagged import to_nested
from dataplane.codec.wire import Column
from dataplane.schema import FieldSchema

__all__ = [
    "KEY_ESCAPE",
    "MARKER",
    "RowsChanged",
    "RESERVED_PREFIX",
    "SCHEMA_PREFIX",
    "decode_schemas",
    "is_reserved",
    "join_fields",
    "schema_key",
    "schema_tag",
    "signature_matches",
    "split_fields",
    "stored_keys",
    "to_tq",
    "user_key",
    "user_listing",
]


class RowsChanged(Exception):
    """Rows of a get were cleared, rewritten or handed to other keys while it read them: read the
    rows' metadata again."""


RESERVED_PREFIX = "__dataplane__"
SCHEMA_PREFIX = RESERVED_PREFIX + "/schema/"
MARKER = "__dataplane__"
# A user's key that begins like a reserved one is stored behind this: no user key holds NUL (the
# core's key rule, dataplane.meta.check_keys), so a stored key that begins with it is such a key.
KEY_ESCAPE = "\x00"


def schema_key(field: str) -> str:
    return SCHEMA_PREFIX + field


def is_reserved(key: str) -> bool:
    return key.startswith(RESERVED_PREFIX)


def stored_keys(keys: Sequence[str]) -> Sequence[str]:
    """The keys TQ holds for a user's ``keys``: each as it is, but one beginning with
    :data:`RESERVED_PREFIX`, which gets :data:`KEY_ESCAPE` in front (so every key the core accepts
    is a key here, and never one of dataplane's own). ``keys`` itself when none needs it."""
    if RESERVED_PREFIX not in "".join(keys):  # one C-level pass: the usual batch
        return keys
    return [KEY_ESCAPE + k if k.startswith(RESERVED_PREFIX) else k for k in keys]


def user_key(stored: str) -> str:
    """The user's key that TQ holds as ``stored`` (undoes :func:`stored_keys`)."""
    return stored[len(KEY_ESCAPE) :] if stored.startswith(KEY_ESCAPE) else stored


def user_listing(listing: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A listing of stored keys (:func:`stored_keys`) as the user's keys, in the same order."""
    for part, rows in listing.items():
        if KEY_ESCAPE in "".join(rows):
            listing[part] = {user_key(k): tags for k, tags in rows.items()}
    return listing


def join_fields(fields: set[str]) -> str:
    return ",".join(sorted(fields))


def split_fields(marker: object) -> set[str]:
    """The fields a row marker names (either layout)."""
    return set(marker.replace(";", ",").split(",")) - {""} if isinstance(marker, str) else set()


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
    if schema.kind != "dense":  # or plain [B, L, *inner] when every row left has one length
        return nested or len(tq_schema.get("shape") or ()) == 1 + len(schema.inner_shape)
    if nested:
        return False
    shape = tuple(tq_schema.get("shape") or ())
    return shape == schema.inner_shape or (schema.inner_shape == () and shape == (1,))
