"""Field schemas: what the first write of a (partition, field) fixes for every later write."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dataplane.errors import SchemaError

__all__ = ["FieldKind", "FieldSchema", "SchemaRegistry", "dtype_from_name", "dtype_name", "schema_of"]

FieldKind = Literal["dense", "jagged", "object"]
ObjectCodecName = Literal["msgpack", "pickle"]

_DTYPES: dict[str, torch.dtype] = {
    name: d
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if isinstance(d := getattr(torch, name, None), torch.dtype)
}


_NAMES = {d: n for n, d in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; raises SchemaError for dtypes we cannot store."""
    name = _NAMES.get(dtype)
    if name is None:
        raise SchemaError(f"dtype {dtype} is not supported; convert the tensor to one of {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise SchemaError(f"unknown dtype name {name!r} in stored schema") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldSchema:
    """Kind, element dtype and trailing shape of one field.

    ``dense``: each row is a tensor of shape ``inner_shape`` (``()`` for per-row scalars).
    ``jagged``: each row is ``[L_i, *inner_shape]`` with its own length ``L_i``.
    ``object``: each row is one encoded Python object (stored as bytes; ``codec`` names the encoding).
    """

    kind: FieldKind
    dtype: torch.dtype
    inner_shape: tuple[int, ...] = ()
    codec: ObjectCodecName | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "jagged", "object"):
            raise SchemaError(f"unknown field kind {self.kind!r}")
        if self.kind == "object" and (self.dtype is not torch.uint8 or self.inner_shape or self.codec is None):
            raise SchemaError("object fields are uint8 bytes with no inner shape and a codec")
        object.__setattr__(self, "inner_shape", tuple(int(d) for d in self.inner_shape))

    @property
    def row_numel(self) -> int:
        """Elements per row (dense) or per token (jagged)."""
        n = 1
        for d in self.inner_shape:
            n *= d
        return n

    @property
    def row_nbytes(self) -> int:
        """Bytes per row (dense) or per element of the leading dim (jagged; 1 for object bytes)."""
        return self.row_numel * self.dtype.itemsize

    def view_rows(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        """``raw`` (uint8, exactly ``rows`` times :attr:`row_nbytes`) as ``[rows, *inner_shape]`` of this
        dtype, without a copy; one view when there is no inner shape (a get does this per field).

        Where ``raw`` is a slice of a larger buffer (a get's fields share one slab or one packed
        object), the result has a storage of its own over exactly these bytes, which keeps the buffer
        alive: ``torch.save`` then writes this field's bytes alone, and fields of other dtypes in the
        same buffer do not look to it like one storage viewed as several types (which it refuses).
        """
        if raw.is_cpu and raw.numel() and raw.untyped_storage().nbytes() != raw.numel():
            # the memoryview (.data) holds the numpy array, which holds ``raw`` and so the buffer's storage
            values = torch.frombuffer(raw.numpy().data, dtype=self.dtype)
        elif not raw.numel():
            values = torch.empty(0, dtype=self.dtype)  # an empty view would still name the buffer's storage
        else:
            values = raw.view(self.dtype)
        return values.view((rows, *self.inner_shape)) if self.inner_shape else values

    def describe(self) -> str:
        if self.kind == "object":
            return f"object[{self.codec}]"
        inner = ", ".join(str(d) for d in self.inner_shape)
        lead = "B, L" if self.kind == "jagged" else "B"
        return f"{self.kind} {dtype_name(self.dtype)}[{lead}{', ' if inner else ''}{inner}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dtype": dtype_name(self.dtype),
            "inner_shape": list(self.inner_shape),
            "codec": self.codec,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FieldSchema:
        return _schema_of(d["kind"], d["dtype"], tuple(d["inner_shape"]), d.get("codec"))


@functools.lru_cache(maxsize=1024)  # every put of a job repeats the same few schemas
def schema_of(kind: FieldKind, dtype: torch.dtype, inner_shape: tuple[int, ...]) -> FieldSchema:
    """``FieldSchema(kind=kind, dtype=dtype, inner_shape=inner_shape)``, made once per distinct value."""
    return FieldSchema(kind=kind, dtype=dtype, inner_shape=inner_shape)


@functools.lru_cache(maxsize=1024)  # every index object a reader decodes repeats the same few schemas
def _schema_of(kind: FieldKind, dtype: str, inner_shape: tuple[int, ...], codec: ObjectCodecName | None) -> FieldSchema:
    return FieldSchema(kind=kind, dtype=dtype_from_name(dtype), inner_shape=inner_shape, codec=codec)


def check_compatible(partition_id: str, field: str, existing: FieldSchema, incoming: FieldSchema) -> None:
    """Raise SchemaError unless ``incoming`` may be written where ``existing`` is recorded."""
    if existing != incoming:
        raise SchemaError(
            f"field {field!r} in partition {partition_id!r} is {existing.describe()} (fixed by its first write), "
            f"got {incoming.describe()}; cast the value to match, write it under a new field name, "
            f"or use a fresh partition (kv_clear(partition_id=...) forgets the schema)"
        )


class SchemaRegistry:
    """Thread-safe per-(partition, field) schemas for stores that keep them in process.

    Adapters whose schema lives in the backend use :func:`check_compatible` directly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._schemas: dict[str, dict[str, FieldSchema]] = {}

    def check(self, partition_id: str, incoming: Mapping[str, FieldSchema]) -> list[str]:
        """Validate ``incoming`` against what is recorded; return the fields that are new."""
        with self._lock:
            known = self._schemas.get(partition_id, {})
            new = []
            for field, schema in incoming.items():
                if field in known:
                    check_compatible(partition_id, field, known[field], schema)
                else:
                    new.append(field)
            return new

    def record(self, partition_id: str, incoming: Mapping[str, FieldSchema]) -> None:
        """Check and record in one step (first write wins)."""
        with self._lock:
            known = self._schemas.setdefault(partition_id, {})
            for field, schema in incoming.items():
                if field in known:
                    check_compatible(partition_id, field, known[field], schema)
            for field, schema in incoming.items():
                known.setdefault(field, schema)

    def get(self, partition_id: str) -> dict[str, FieldSchema]:
        with self._lock:
            return dict(self._schemas.get(partition_id, {}))

    def forget(self, partition_id: str, fields: Iterable[str] | None = None) -> None:
        with self._lock:
            if fields is None:
                self._schemas.pop(partition_id, None)
                return
            known = self._schemas.get(partition_id, {})
            for f in fields:
                known.pop(f, None)
            if not known:
                self._schemas.pop(partition_id, None)
