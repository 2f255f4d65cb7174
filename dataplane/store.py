"""Compatibility re-export: the interface lives in :mod:`dataplane.storage`, the client in :mod:`dataplane.store_client`."""

from dataplane.storage import KVStore, PendingGet, PendingPut
from dataplane.store_client import StoreClient

__all__ = ["KVStore", "PendingGet", "PendingPut", "StoreClient"]
