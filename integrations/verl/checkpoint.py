"""Checkpoints of what a dataplane deployment holds, for the verl facade: a thin use of the core's
snapshots (:mod:`dataplane.snapshot`).

A Mooncake deployment's rows die with the process that lent their memory, so a verl checkpoint must
copy them out. :func:`save` writes every partition (its keys in listing order, their tags, and each
field's rows) to a directory as a core snapshot: plain files (``torch.save`` tensors read back with
``weights_only=True``, msgpack, a JSON manifest with every file's sha256), swapped in atomically (a
crash at any point leaves the previous checkpoint loadable and whole). :func:`load` replaces what the
deployment holds with it, as TransferQueue's load does; a damaged or foreign directory raises
``dataplane.SnapshotError`` and changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dataplane import DataPlaneClient
from dataplane.snapshot import FORMAT as SNAPSHOT_FORMAT
from dataplane.snapshot import FORMAT_VERSION, load_snapshot, save_snapshot

__all__ = ["FORMAT", "load", "save"]

FORMAT = f"{SNAPSHOT_FORMAT}/{FORMAT_VERSION}"
"""What :func:`save` writes: a core snapshot (``dataplane-snapshot``, format version 1)."""


def save(client: DataPlaneClient, directory: str | os.PathLike[str], *, metadata: Any = None) -> Path:
    """Write every partition ``client``'s deployment holds to ``directory`` (replacing the checkpoint
    there atomically; :func:`dataplane.snapshot.save_snapshot`). Returns the directory. ``metadata``
    (JSON-serialisable) comes back from :func:`load`.

    >>> import tempfile, torch, dataplane
    >>> from integrations.verl import checkpoint
    >>> folder = tempfile.mkdtemp()
    >>> with dataplane.connect() as old:
    ...     _ = old.kv_batch_put(["a", "b"], {"r": torch.tensor([1.0, 2.0])}, partition_id="train", tags=[{"s": 1}, {}])
    ...     _ = checkpoint.save(old, f"{folder}/ckpt", metadata={"step": 3})
    >>> with dataplane.connect() as new:  # another store: the saved rows come back
    ...     checkpoint.load(new, f"{folder}/ckpt"), new.kv_list(), new.kv_batch_get(["b"], select_fields="r", partition_id="train")["r"]
    ({'step': 3}, {'train': {'a': {'s': 1}, 'b': {}}}, tensor([2.]))
    """
    save_snapshot(client, directory, metadata=metadata)
    return Path(directory)


def load(client: DataPlaneClient, directory: str | os.PathLike[str], *, replace: Sequence[str] | None = None) -> Any:
    """Make ``client``'s deployment hold what :func:`save` wrote to ``directory``: each saved partition
    is replaced by its saved rows (listing order, tags, fields), then every other partition it holds
    (or only those in ``replace``) is cleared. Returns the saved metadata.

    Nothing changes if the checkpoint is missing (``SnapshotNotFound``, a ``FileNotFoundError``),
    damaged or foreign (``SnapshotError``), or the store fails while it is loaded."""
    info = load_snapshot(client, directory)
    for pid in client.kv_list() if replace is None else replace:
        if pid not in info.partitions:
            client.kv_clear(partition_id=pid)
    return info.metadata
