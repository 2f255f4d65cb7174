"""The storage interface a third-party adapter implements, and what it needs to implement it.

TEMPORARY SHIM (issue 32): re-exports under the final public names; replaced by the real module of
the store/client split. See docs/extending.md.
"""

from dataplane.client import Capabilities, Listing
from dataplane.codec.wire import Column
from dataplane.errors import missing_rows_error
from dataplane.meta import KVBatchMeta
from dataplane.schema import FieldKind, FieldSchema, SchemaRegistry, check_compatible, schema_of
from dataplane.store import KVStore

__all__ = [
    "Capabilities",
    "Column",
    "FieldKind",
    "FieldSchema",
    "KVBatchMeta",
    "KVStore",
    "Listing",
    "SchemaRegistry",
    "check_compatible",
    "missing_rows_error",
    "schema_of",
]
