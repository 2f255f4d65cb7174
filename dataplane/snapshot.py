"""Snapshots: a deployment's partitions as plain files that any backend loads back.

:func:`save_snapshot` writes partitions (all, or those named) of a deployment to a directory;
:func:`load_snapshot` puts them into a deployment of any backend (the same one, a later one, another
backend): each partition's keys in listing order, their tags, tag-only rows, and every field
bit-exact (dense, jagged, object columns). A Mooncake deployment's rows die with the process that
lent their memory; a snapshot is how they outlive it.

Format (``dataplane-snapshot``, version 1): no pickle anywhere. ::

    DIR/
      CURRENT          JSON {"version": "v000003", "manifest_sha256": ...}: the snapshot DIR holds
      .lock            locked (flock) by the one save writing to DIR
      v000003/
        manifest.json  JSON: format, version, created, backend, metadata, partitions, and every file's
                       size and sha256
        p0.rows        msgpack {"keys": [...], "tags": [...], "groups": [[row index, ...], ...]}
        p0.g0.pt       torch.save({"dense": {f: T}, "values": {f: T}, "offsets": {f: T}}) of one group of
                       rows sharing a field set (jagged fields as values + offsets), read back with
                       torch.load(weights_only=True)
        p0.g0.objects  msgpack {f: [one object per row]}: the group's object columns

Guarantees:

- **Atomic.** A save writes a new version directory beside the current one (``.tmp-*``), fsyncs each
  file and the directory, renames it to ``vNNNNNN``, then replaces ``CURRENT`` (written beside,
  fsynced, renamed over, the directory fsynced) and only then removes older versions. A process killed
  at any point leaves ``CURRENT`` naming a whole snapshot: the previous one or the new one.
- **Verified.** A load checks the manifest against ``CURRENT`` and every file against the manifest
  (size, sha256), and reads every file's structure, before it writes anything: a damaged, partial or
  foreign directory raises :class:`~dataplane.errors.SnapshotError` (or ``SnapshotNotFound``) naming
  the file and what is wrong, and the store is unchanged.
- **Consistent or refused.** Rows that change while a save reads them are never saved half old and
  half new: a save reads every listing, every row's fields and values, then reads them all again and
  compares (listings and field sets exactly, values by sha256). Equal, the snapshot is the store at
  one instant (between the two reads; a value changed and changed back in between is not seen). Not
  equal, the attempt is thrown away and the save tries again, up to ``attempts`` times, then raises
  :class:`~dataplane.errors.SnapshotConflict`: pause writers of the saved partitions for a snapshot
  that must succeed. A save costs two reads of the rows.
- **Load changes all or nothing.** A load that fails while writing (a full store, a dead backend)
  removes what it wrote and puts back what the partitions held before (kept in memory while loading).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import dataplane
from dataplane._snapshot_files import (
    _LOCK,
    _TMP,
    _VERSION,
    CURRENT,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    _files_of,
    _fsync_dir,
    _ours,
    _pack,
    _preview,
    _read_partition,
    _resolve,
    _Rows,
    _verify,
    _write_file,
)
from dataplane.client import DataPlaneClient
from dataplane.errors import InvalidArgument, KeyNotFound, SnapshotConflict, SnapshotError

__all__ = ["FORMAT", "FORMAT_VERSION", "SnapshotInfo", "load_snapshot", "save_snapshot", "snapshot_info"]


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """What a snapshot holds, from its manifest.

    Attributes:
        path: the version directory read or written (``DIR/vNNNNNN``).
        partitions: partition id -> rows, in the saved order (those loaded, for a load).
        metadata: what the save's ``metadata`` was (JSON).
        created: when the save finished (ISO 8601, UTC).
        backend: the backend the rows were saved from (``capabilities.backend``).
        nbytes: bytes of the files the manifest lists (the data; the manifest itself not counted).
    """

    path: Path
    partitions: dict[str, int]
    metadata: Any
    created: str
    backend: str
    nbytes: int


# -- reading rows from a store ---------------------------------------------------------------------
def _listing(client: DataPlaneClient, pids: Sequence[str] | None) -> dict[str, dict[str, dict[str, Any]]]:
    if pids is None:
        return {pid: rows for pid, rows in client.kv_list().items() if rows}
    return {pid: client.kv_list(pid).get(pid, {}) for pid in pids}


def _field_sets(client: DataPlaneClient, pid: str, keys: list[str]) -> list[frozenset[str]] | None:
    """Each key's fields, or None if a key is gone (cleared since it was listed)."""
    info = client.kv_describe(keys, partition_id=pid) if keys else {}
    if len(info) != len(keys):
        return None
    return [info[k].fields for k in keys]


def _grouped(fields: list[frozenset[str]], rows_per_file: int) -> list[tuple[list[int], list[str]]]:
    """Row indexes by field set (first-seen order, at most ``rows_per_file`` a group); tag-only rows
    are in none."""
    by_set: dict[frozenset[str], list[int]] = {}
    for i, fs in enumerate(fields):
        if fs:
            by_set.setdefault(fs, []).append(i)
    return [
        (idx[s : s + rows_per_file], sorted(fs))
        for fs, idx in by_set.items()
        for s in range(0, len(idx), rows_per_file)
    ]


_Tensors = dict[str, dict[str, torch.Tensor]]  # {"dense" | "values" | "offsets": {field: tensor}}


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in memory of their own (``torch.save`` writes a tensor's whole storage)."""
    t = t.resolve_conj().resolve_neg().contiguous()
    return t if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes else t.clone()


def _columns_of(got: Any, fields: list[str]) -> tuple[dict[str, str], _Tensors, dict[str, list[Any]]]:
    kinds: dict[str, str] = {}
    tensors: _Tensors = {"dense": {}, "values": {}, "offsets": {}}
    objects: dict[str, list[Any]] = {}
    for f in fields:
        v = got[f]
        if isinstance(v, torch.Tensor) and v.is_nested:
            values, offsets = v.values(), v.offsets()  # type: ignore[attr-defined]
            if getattr(v, "_lengths", None) is not None or int(offsets[0]) != 0 or offsets[-1] != len(values):
                rows = v.unbind()  # rows with gaps between them: packed
                values = torch.cat(rows) if rows else values[:0]
                offsets = torch.tensor([0, *itertools.accumulate(len(r) for r in rows)], dtype=torch.int64)
            tensors["values"][f], tensors["offsets"][f] = _own(values), _own(offsets)
            kinds[f] = "jagged"
        elif isinstance(v, torch.Tensor):
            tensors["dense"][f] = _own(v)
            kinds[f] = "dense"
        else:
            objects[f] = list(v)
            kinds[f] = "object"
    return kinds, tensors, objects


def _digest(tensors: _Tensors, objects_blob: bytes) -> bytes:
    sha = hashlib.sha256()
    for part, named in tensors.items():
        for f, t in named.items():
            sha.update(_pack([part, f, str(t.dtype), list(t.shape)]))
            sha.update(t.reshape(-1).view(torch.uint8).numpy().data)
    sha.update(objects_blob)
    return sha.digest()


def _objects_blob(pid: str, objects: dict[str, list[Any]]) -> bytes:
    try:
        return _pack(objects) if objects else b""
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgument(
            f"an object column of partition {pid!r} ({_preview(sorted(objects))}) holds values msgpack cannot "
            f"store ({e}); snapshots keep object columns as msgpack: store such values as str/bytes/lists/dicts"
        ) from e


def _capture(client: DataPlaneClient, pid: str) -> _Rows:
    """Everything ``pid`` holds, in memory (what a load puts back if it fails)."""
    rows = client.kv_list(pid).get(pid, {})
    keys = list(rows)
    fields = _field_sets(client, pid, keys)
    if fields is None:
        raise SnapshotConflict(f"rows of partition {pid!r} were cleared while a load backed them up; load again")
    groups = []
    for idx, names in _grouped(fields, 1 << 62):
        members = [keys[i] for i in idx]
        got = client.kv_batch_get(members, select_fields=names, partition_id=pid)
        groups.append((members, {f: got[f] for f in names}))
    return _Rows(pid, keys, [rows[k] for k in keys], groups)


def _put_rows(client: DataPlaneClient, rows: _Rows) -> None:
    if rows.keys:  # every row first, in listing order with its tags; then each group's fields
        client.kv_batch_put(rows.keys, None, partition_id=rows.pid, tags=rows.tags)
    for keys, columns in rows.groups:
        client.kv_batch_put(keys, columns, partition_id=rows.pid)


# -- save ------------------------------------------------------------------------------------------
def _check_partitions(partitions: Sequence[str] | None) -> list[str] | None:
    if partitions is None:
        return None
    if isinstance(partitions, str) or not all(isinstance(p, str) for p in partitions):
        raise InvalidArgument(f"partitions must be a list of partition ids (or None for all), got {partitions!r}")
    out = list(partitions)
    if len(set(out)) != len(out):
        raise InvalidArgument(f"partitions names a partition twice: {out!r}")
    return out


@contextlib.contextmanager
def _save_lock(root: Path) -> Iterator[None]:
    fd = os.open(root / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SnapshotConflict(f"another save is writing to {root} now; wait for it to finish") from None
        yield
    finally:
        os.close(fd)  # releases the lock (a killed process's lock goes with it)


def _attempt(client: DataPlaneClient, pids: list[str] | None, tmp: Path, rows_per_file: int) -> tuple[Any, str]:
    """Write one attempt's files to ``tmp``; returns (partitions, files) and "" or what changed."""
    files: dict[str, Any] = {}
    listing = _listing(client, pids)
    fields = {pid: _field_sets(client, pid, list(rows)) for pid, rows in listing.items()}
    parts, reads = [], []
    for i, (pid, rows) in enumerate(listing.items()):
        keys, field_sets = list(rows), fields[pid]
        if field_sets is None:
            return None, f"rows of partition {pid!r} were cleared while it was listed"
        groups = _grouped(field_sets, rows_per_file)
        entries = []
        for j, (idx, names) in enumerate(groups):
            members = [keys[k] for k in idx]
            try:
                got = client.kv_batch_get(members, select_fields=names, partition_id=pid)
            except KeyNotFound:
                return None, f"rows of partition {pid!r} were cleared while they were read"
            kinds, tensors, objects = _columns_of(got, names)
            blob = _objects_blob(pid, objects)
            reads.append((pid, members, names, _digest(tensors, blob)))
            entry: dict[str, Any] = {"rows": len(idx), "fields": kinds, "tensors": None, "objects": None}
            if any(tensors.values()):
                entry["tensors"] = f"p{i}.g{j}.pt"
                _write_file(tmp, entry["tensors"], files, tensors)
            if blob:
                entry["objects"] = f"p{i}.g{j}.objects"
                _write_file(tmp, entry["objects"], files, blob)
            entries.append(entry)
        body = {"keys": keys, "tags": [rows[k] for k in keys], "groups": [idx for idx, _ in groups]}
        _write_file(tmp, f"p{i}.rows", files, _pack(body))
        parts.append({"id": pid, "rows": len(keys), "listing": f"p{i}.rows", "groups": entries})
    for pid, members, names, digest in reads:  # the second read: every value as the first read saw it?
        try:
            got = client.kv_batch_get(members, select_fields=names, partition_id=pid)
        except KeyNotFound:
            return None, f"rows of partition {pid!r} were cleared while they were read"
        _, tensors, objects = _columns_of(got, names)
        if _digest(tensors, _objects_blob(pid, objects)) != digest:
            return None, f"values of rows of partition {pid!r} ({_preview(members, 3)}) changed while they were read"
    again = _listing(client, pids)
    moved = [p for p in {**listing, **again} if _pack(listing.get(p)) != _pack(again.get(p))]
    if moved:
        return None, f"the keys, order or tags of partition(s) {_preview(moved)} changed while they were read"
    for pid, rows in again.items():
        if _field_sets(client, pid, list(rows)) != fields[pid]:
            return None, f"the fields of rows of partition {pid!r} changed while they were read"
    return (parts, files), ""


def _next_version(root: Path) -> str:
    numbers = [int(m.group(1)) for e in os.listdir(root) if (m := _VERSION.fullmatch(e))]
    return f"v{max(numbers, default=0) + 1:06d}"


def _prune(root: Path, keep: str) -> None:
    for name in os.listdir(root):
        if name != keep and _ours(name):
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def save_snapshot(
    client: DataPlaneClient,
    path: str | os.PathLike[str],
    partitions: Sequence[str] | None = None,
    *,
    metadata: Any = None,
    attempts: int = 3,
    rows_per_file: int = 4096,
) -> SnapshotInfo:
    """Save ``partitions`` (all the deployment holds, by default) of ``client``'s deployment to the
    directory ``path``, replacing the snapshot there atomically (see the module docstring: format and
    guarantees). Returns what was saved.

    Args:
        client: a client of the deployment to save.
        path: the snapshot directory: new, empty, or one this function wrote (anything else there is
            refused, never overwritten).
        partitions: partition ids to save (a named partition that holds no row is saved empty, so a
            load empties it); None saves every partition that holds rows.
        metadata: anything JSON can hold, kept in the manifest (``SnapshotInfo.metadata``).
        attempts: how many times to read the rows again when they changed while being read, before
            raising ``SnapshotConflict``.
        rows_per_file: rows of one field set per tensor file (bounds the memory a save holds).

    Raises:
        SnapshotConflict: rows changed during every attempt, or another save writes to ``path``; the
            previous snapshot is kept.
        SnapshotError: ``path`` holds files that are not a snapshot's, or cannot be written.
        InvalidArgument: bad arguments, or object values msgpack cannot store (fields written with
            ``pickle_fields``).

    >>> import tempfile, torch, dataplane
    >>> from dataplane.snapshot import load_snapshot, save_snapshot
    >>> folder = tempfile.mkdtemp()
    >>> with dataplane.connect() as old:
    ...     _ = old.kv_batch_put(["a", "b"], {"r": torch.tensor([1.0, 2.0])}, partition_id="train", tags=[{"s": 1}, {}])
    ...     save_snapshot(old, folder, metadata={"step": 3}).partitions
    {'train': 2}
    >>> with dataplane.connect() as new:  # another store: the saved rows come back
    ...     load_snapshot(new, folder).metadata, new.kv_list(), new.kv_batch_get(["b"], select_fields="r", partition_id="train")["r"]
    ({'step': 3}, {'train': {'a': {'s': 1}, 'b': {}}}, tensor([2.]))
    """
    pids = _check_partitions(partitions)
    try:
        meta_json = json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"metadata must be JSON-serialisable (dicts, lists, str, finite numbers): {e}") from e
    for name, value in (("attempts", attempts), ("rows_per_file", rows_per_file)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")
    root = Path(path)
    try:
        if not root.is_dir():
            root.mkdir(parents=True)
            _fsync_dir(root.parent)
    except (FileExistsError, NotADirectoryError) as e:
        raise SnapshotError(f"cannot save a snapshot to {root}: it is a file, not a directory") from e
    foreign = sorted(n for n in os.listdir(root) if n not in (CURRENT, _LOCK) and not _ours(n))
    if foreign:
        raise SnapshotError(
            f"{root} holds files that are not a snapshot's ({_preview(foreign)}); save to a new or empty "
            "directory, or to one save_snapshot wrote"
        )
    with _save_lock(root):
        changed = ""
        for _ in range(attempts):
            tmp = root / f"{_TMP}{uuid.uuid4().hex}"
            tmp.mkdir()
            try:
                done, changed = _attempt(client, pids, tmp, rows_per_file)
                if done is None:
                    continue
                parts, files = done
                manifest = {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "dataplane": dataplane.__version__,
                    "backend": client.capabilities.backend,
                    "metadata": meta_json,
                    "partitions": parts,
                    "files": files,
                }
                record: dict[str, Any] = {}
                _write_file(tmp, MANIFEST, record, json.dumps(manifest, indent=1).encode())
                _fsync_dir(tmp)
                version = _next_version(root)
                os.rename(tmp, root / version)
                _fsync_dir(root)
                pointer = json.dumps({"version": version, "manifest_sha256": record[MANIFEST]["sha256"]}).encode()
                staged = root / f"{CURRENT}{_TMP}{uuid.uuid4().hex}"
                _write_file(root, staged.name, {}, pointer)
                os.replace(staged, root / CURRENT)  # the switch: CURRENT names the new version from here
                _fsync_dir(root)
                _prune(root, keep=version)
                return _info(root / version, manifest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # an attempt thrown away, or a save that failed
        raise SnapshotConflict(
            f"rows changed while they were saved, on each of {attempts} attempt(s) (last: {changed}); the snapshot "
            f"at {root} is unchanged. Pause the writers of these partitions during the save, or pass more attempts"
        )


def _info(folder: Path, manifest: dict[str, Any], parts: list[dict[str, Any]] | None = None) -> SnapshotInfo:
    return SnapshotInfo(
        path=folder,
        partitions={p["id"]: p["rows"] for p in (manifest["partitions"] if parts is None else parts)},
        metadata=manifest.get("metadata"),
        created=str(manifest.get("created", "")),
        backend=str(manifest.get("backend", "")),
        nbytes=sum(rec["bytes"] for rec in manifest["files"].values()),
    )


def snapshot_info(path: str | os.PathLike[str], *, verify: bool = False) -> SnapshotInfo:
    """What the snapshot at ``path`` holds (its manifest, checked), without touching any store;
    ``verify=True`` also checks every file's size and sha256 and reads its structure (as a load does
    before writing). Raises ``SnapshotNotFound`` or ``SnapshotError`` as :func:`load_snapshot` does."""
    folder, manifest = _resolve(path)
    if verify:
        _verify(folder, manifest, list(manifest["files"]))
        for part in manifest["partitions"]:
            _read_partition(folder, part)
    return _info(folder, manifest)


def load_snapshot(
    client: DataPlaneClient,
    path: str | os.PathLike[str],
    partitions: Sequence[str] | None = None,
    *,
    replace: bool = True,
) -> SnapshotInfo:
    """Put the snapshot at ``path`` (a directory :func:`save_snapshot` wrote) into ``client``'s
    deployment, of any backend: each partition's keys in their saved listing order, their tags,
    tag-only rows, and every field as saved. Returns what was loaded (``metadata`` included).

    Everything is checked before the first write (see the module docstring); a load that fails
    while writing undoes what it wrote, so a failed load leaves the store as it was. Partitions the
    snapshot does not hold are never touched. Don't write to the partitions being loaded meanwhile.

    Args:
        partitions: ids of the saved partitions to load; None loads every one.
        replace: True, each loaded partition is emptied first and holds exactly the snapshot's rows;
            False, the rows are added to what the partition holds (its keys keep their places, the
            snapshot's come after), and a key both hold is refused before anything is written.

    Raises:
        SnapshotNotFound: no snapshot at ``path``.
        SnapshotError: the snapshot is damaged, partial or foreign (the message names the file and
            what is wrong), or the load failed and could not be undone.
        InvalidArgument: a named partition is not in the snapshot; keys clash with ``replace=False``.
        CapacityExceeded, BackendUnavailable, ...: the store's own error, after the load was undone.
    """
    wanted = _check_partitions(partitions)
    folder, manifest = _resolve(path)
    parts = manifest["partitions"]
    if wanted is not None:
        by_id = {p["id"]: p for p in parts}
        missing = [p for p in wanted if p not in by_id]
        if missing:
            raise InvalidArgument(
                f"partition(s) {_preview(missing)} are not in the snapshot at {folder}; it holds {_preview(list(by_id))}"
            )
        parts = [by_id[p] for p in wanted]
    _verify(folder, manifest, [name for p in parts for name in _files_of(p)])
    plans = [_read_partition(folder, p) for p in parts]
    before = {plan.pid: client.kv_list(plan.pid).get(plan.pid, {}) for plan in plans}
    if not replace:
        for plan in plans:
            clash = [k for k in plan.keys if k in before[plan.pid]]
            if clash:
                raise InvalidArgument(
                    f"partition {plan.pid!r} already holds {len(clash)} of the snapshot's keys ({_preview(clash)}); "
                    "pass replace=True to replace the partition, or clear those keys first"
                )
    backups = {pid: _capture(client, pid) for pid, rows in before.items() if replace and rows}
    touched: list[_Rows] = []
    try:
        for plan in plans:
            touched.append(plan)
            if replace:
                client.kv_clear(partition_id=plan.pid)
            _put_rows(client, plan)
    except BaseException as exc:
        for plan in touched:
            try:
                if replace or not before[plan.pid]:
                    client.kv_clear(partition_id=plan.pid)
                else:
                    client.kv_clear(plan.keys, partition_id=plan.pid)
                if plan.pid in backups:
                    _put_rows(client, backups[plan.pid])
            except Exception as undo:
                raise SnapshotError(
                    f"loading {folder} failed ({exc!r}) and undoing it failed too ({undo!r}): partition "
                    f"{plan.pid!r} may hold part of the snapshot; clear it (kv_clear(partition_id=...)) and load again"
                ) from exc
        raise
    return _info(folder, manifest, parts)
