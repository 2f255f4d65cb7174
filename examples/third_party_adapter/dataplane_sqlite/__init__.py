"""dataplane-sqlite: a third-party dataplane adapter for ``sqlite://`` URLs (see store.py)."""

from dataplane_sqlite.store import SqliteStore, connect

__all__ = ["SqliteStore", "connect"]
