"""Codec: jagged <-> padded, the wire form of fields, object columns."""

from dataplane.codec.jagged import (
    Ragged,
    RaggedCache,
    materialize,
    offsets_from_lengths,
    pack,
    pack_nested,
    padded_width,
    to_nested,
)
from dataplane.codec.wire import Column, decode_columns, encode_fields

__all__ = [
    "Column",
    "Ragged",
    "RaggedCache",
    "decode_columns",
    "encode_fields",
    "materialize",
    "offsets_from_lengths",
    "pack",
    "pack_nested",
    "padded_width",
    "to_nested",
]
