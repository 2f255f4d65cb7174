"""Typed errors of the data plane.

Every error derives from :class:`DataPlaneError` and, where one fits, from the matching builtin, so
callers can catch ``KeyError`` or ``TimeoutError`` without importing this module. Messages say what
was wrong and how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "BackendUnavailable",
    "CapacityExceeded",
    "ClientClosed",
    "DataPlaneError",
    "DataPlaneTimeout",
    "DeploymentMismatch",
    "InvalidArgument",
    "KeyNotFound",
    "SchemaError",
    "SnapshotConflict",
    "SnapshotError",
    "SnapshotNotFound",
    "missing_rows_error",
]


class DataPlaneError(Exception):
    """Base class of every error raised by dataplane."""


class KeyNotFound(DataPlaneError, KeyError):
    """A requested key, or a requested field on some key, is not in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SchemaError(DataPlaneError, TypeError):
    """A value's type, dtype, kind or trailing shape does not fit the field's schema."""


class InvalidArgument(DataPlaneError, ValueError):
    """An argument has the right type but a bad value (duplicate keys, size mismatch, ...)."""


class DeploymentMismatch(InvalidArgument):
    """A meta was written to one deployment and read through a client of another.

    Its rows are not in this store: connect to the deployment the meta names (its ``client.url``),
    or ship the meta to a process of that deployment.
    """


class CapacityExceeded(DataPlaneError):
    """The store is full; nothing of the rejected put was written."""


class BackendUnavailable(DataPlaneError):
    """The backend is not installed, not reachable, or died."""


class DataPlaneTimeout(DataPlaneError, TimeoutError):
    """A blocking call did not finish within its timeout."""


class ClientClosed(DataPlaneError):
    """The client was used after ``close()``."""


class SnapshotError(DataPlaneError):
    """A snapshot directory is damaged or foreign (a file missing, truncated or not matching its
    checksum, a manifest of another format or a newer version), or a snapshot cannot be written
    there; the message names the file and what is wrong. The store is unchanged (the one exception,
    which says so: a load failed and undoing it failed too)."""


class SnapshotNotFound(SnapshotError, FileNotFoundError):
    """There is no snapshot at the path (it does not exist, or holds no snapshot's files)."""


class SnapshotConflict(SnapshotError):
    """Rows changed while a save read them, on every attempt (or another save holds the directory):
    the save was refused and the previous snapshot there is kept as it was."""


def _preview(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(x) for x in items[:limit])
    more = len(items) - limit
    return shown + (f", ... ({more} more)" if more > 0 else "")


def missing_rows_error(
    partition_id: str,
    missing_keys: Iterable[str] = (),
    missing_fields: Mapping[str, Sequence[str]] | None = None,
) -> KeyNotFound:
    """Build the one ``KeyNotFound`` every adapter raises for absent keys or fields.

    Args:
        partition_id: partition that was read.
        missing_keys: keys absent from the partition.
        missing_fields: field -> keys of the requested rows that lack that field.
    """
    parts: list[str] = []
    keys = list(missing_keys)
    if keys:
        parts.append(f"{len(keys)} key(s) not in partition {partition_id!r}: {_preview(keys)}")
    for field, on_keys in sorted((missing_fields or {}).items()):
        parts.append(f"field {field!r} missing on {len(on_keys)} row(s): {_preview(list(on_keys))}")
    hint = "put them first, or check partition_id and select_fields (kv_list shows what is stored)"
    return KeyNotFound("; ".join(parts) + f" -- {hint}")
