""":class:`StoreClient`: the client semantics over any :class:`dataplane.storage.KVStore`.

TEMPORARY SHIM (issue 32): re-exports under the final public name; replaced by the real module of
the store/client split.
"""

from dataplane.store import StoreClient

__all__ = ["StoreClient"]
