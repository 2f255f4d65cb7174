"""The files of a snapshot (:mod:`dataplane.snapshot`): writing them durably, and reading them back
checked -- the manifest against ``CURRENT``, every file against the manifest (size, sha256), every
file's structure -- before a load writes anything to a store."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

import dataplane
from dataplane.codec.wire import validate_field_name
from dataplane.errors import InvalidArgument, SchemaError, SnapshotError, SnapshotNotFound
from dataplane.meta import check_keys
from dataplane.store_client import _check_partition

FORMAT = "dataplane-snapshot"
FORMAT_VERSION = 1
CURRENT = "CURRENT"
MANIFEST = "manifest.json"
_LOCK = ".lock"
_TMP = ".tmp-"
_VERSION = re.compile(r"v(\d{6,})")
_FILE = re.compile(r"p\d+\.(rows|g\d+\.(pt|objects))")
_KINDS = ("dense", "jagged", "object")
_PARTS = ("dense", "values", "offsets")  # a group's tensor file: {part: {field: tensor}}


# -- files ---------------------------------------------------------------------------------------
def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class _HashingWriter:
    """A file's ``write`` that also counts and hashes what goes through (``torch.save`` writes here)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.nbytes = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.nbytes += memoryview(data).nbytes
        return int(self.f.write(data))

    def flush(self) -> None:
        self.f.flush()


def _write_file(folder: Path, name: str, files: dict[str, Any], payload: bytes | dict[str, Any]) -> None:
    """Write ``payload`` (bytes, or tensors for ``torch.save``) to the new file ``folder/name``, fsync
    it, and record its size and sha256 in ``files``."""
    with open(folder / name, "xb") as f:
        w = _HashingWriter(f)
        if isinstance(payload, bytes):
            w.write(payload)
        else:
            torch.save(payload, w)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    files[name] = {"bytes": w.nbytes, "sha256": w.sha.hexdigest()}


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def _ours(name: str) -> bool:
    """Names a save writes in DIR (besides CURRENT and .lock): versions and what a killed save left."""
    return bool(_VERSION.fullmatch(name)) or name.startswith(_TMP) or name.startswith(CURRENT + _TMP)


def _preview(items: Sequence[str], limit: int = 6) -> str:
    more = len(items) - limit
    return ", ".join(repr(x) for x in items[:limit]) + (f", ... ({more} more)" if more > 0 else "")


@dataclass(slots=True)
class _Rows:
    """One partition's rows: keys in listing order, their tags, and groups of rows sharing fields."""

    pid: str
    keys: list[str]
    tags: list[dict[str, Any]]
    groups: list[tuple[list[str], dict[str, Any]]]  # (keys, {field: column as a put takes it})


# -- load ------------------------------------------------------------------------------------------
def _fail(where: Path, what: str) -> SnapshotError:
    return SnapshotError(f"{where}: {what}; the snapshot is damaged or not one dataplane wrote (nothing was loaded)")


def _json_of(path: Path, data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise _fail(path, f"not valid JSON ({e})") from e


def _resolve(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The version directory ``path`` names and its manifest, checked."""
    root = Path(path)
    if not root.is_dir():
        what = "is a file, not a snapshot directory" if root.exists() else "does not exist"
        raise SnapshotNotFound(f"no snapshot at {root}: the path {what}")
    expected: Any = None
    if (root / CURRENT).is_file():
        try:
            pointer = _json_of(root / CURRENT, (root / CURRENT).read_bytes())
        except OSError as e:
            raise _fail(root / CURRENT, f"cannot be read ({e.strerror or e})") from e
        name, expected = (
            (pointer.get("version"), pointer.get("manifest_sha256")) if isinstance(pointer, dict) else ("", "")
        )
        if not isinstance(name, str) or not _VERSION.fullmatch(name) or not isinstance(expected, str):
            raise _fail(root / CURRENT, "does not name a version directory and its manifest's sha256")
        folder = root / name
    elif (root / MANIFEST).is_file():
        folder = root  # a version directory itself
    else:
        entries = sorted(os.listdir(root))
        held = (
            "; a save into it did not finish"
            if entries and all(_ours(e) or e == _LOCK for e in entries)
            else f"; it holds {_preview(entries)}"
            if entries
            else " (it is empty)"
        )
        raise SnapshotNotFound(f"no snapshot at {root}: no {CURRENT} and no {MANIFEST} file{held}")
    try:
        data = (folder / MANIFEST).read_bytes()
    except OSError as e:
        raise _fail(folder, f"its {MANIFEST} cannot be read ({e.strerror or e})") from e
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise _fail(folder / MANIFEST, f"does not match the sha256 that {root / CURRENT} records")
    manifest = _json_of(folder / MANIFEST, data)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise _fail(folder / MANIFEST, f"is not a dataplane snapshot's manifest (format {found!r}, not {FORMAT!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise SnapshotError(
            f"{folder / MANIFEST} is format version {version!r}; this dataplane ({dataplane.__version__}) reads "
            f"versions up to {FORMAT_VERSION}: load it with the dataplane that wrote it, or a newer one"
        )
    _check_manifest(folder / MANIFEST, manifest)
    return folder, manifest


def _check_manifest(where: Path, m: dict[str, Any]) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise _fail(where, what)

    files: Any = m.get("files")
    parts: Any = m.get("partitions")
    need(isinstance(files, dict) and isinstance(parts, list), "no 'files' table or 'partitions' list")
    for name, rec in files.items():
        need(bool(_FILE.fullmatch(name)), f"lists a file of an unexpected name, {name!r}")
        ok = isinstance(rec, dict) and type(rec.get("bytes")) is int and isinstance(rec.get("sha256"), str)
        need(ok, f"no size or sha256 for {name!r}")

    def listed(value: Any) -> bool:
        return isinstance(value, str) and value in files

    ids = []
    for p in parts:
        need(isinstance(p, dict) and isinstance(p.get("id"), str), "a partition without an id")
        pid = p["id"]
        try:
            _check_partition(pid)
        except InvalidArgument as e:
            raise _fail(where, f"a partition id no store takes ({e})") from None
        ok = type(p.get("rows")) is int and listed(p.get("listing")) and isinstance(p.get("groups"), list)
        need(ok, f"partition {pid!r} has no rows file or no groups")
        for g in p["groups"]:
            fields: Any = g.get("fields") if isinstance(g, dict) else None
            ok = isinstance(fields, dict) and bool(fields) and all(k in _KINDS for k in fields.values())
            need(ok and type(g.get("rows")) is int and g["rows"] > 0, f"a group of {pid!r} has no rows or bad fields")
            try:
                for f in fields:
                    validate_field_name(f)
            except SchemaError as e:
                raise _fail(where, f"a field no store takes ({e})") from None
            kinds = set(fields.values())
            ok = listed(g.get("tensors")) if kinds - {"object"} else g.get("tensors") is None
            ok &= listed(g.get("objects")) if "object" in kinds else g.get("objects") is None
            need(ok, f"a group of {pid!r} does not name the files its fields are in")
        ids.append(pid)
    need(len(set(ids)) == len(ids), "a partition listed twice")


def _files_of(part: dict[str, Any]) -> list[str]:
    return [part["listing"]] + [g[k] for g in part["groups"] for k in ("tensors", "objects") if g.get(k)]


def _verify(folder: Path, manifest: dict[str, Any], names: list[str]) -> None:
    for name in names:
        rec, path = manifest["files"][name], folder / name
        try:
            size = path.stat().st_size
        except OSError:
            raise _fail(path, "is missing (the manifest lists it)") from None
        if size != rec["bytes"]:
            raise _fail(path, f"has {size} bytes, the manifest says {rec['bytes']} (truncated or changed)")
        if _sha256_of(path) != rec["sha256"]:
            raise _fail(path, "does not match its sha256 in the manifest (corrupt)")


def _column(where: Path, f: str, kind: str, tensors: Any, objects: Any, n: int) -> Any:
    def need(ok: bool) -> None:
        if not ok:
            raise _fail(where, f"field {f!r} ({kind}) is not {n} rows of that kind")

    if kind == "object":
        col = objects.get(f) if isinstance(objects, dict) else None
        need(isinstance(col, list) and len(col) == n)
        return col
    if kind == "dense":
        t = tensors.get("dense", {}).get(f)
        need(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n)
        return t
    values, offsets = tensors.get("values", {}).get(f), tensors.get("offsets", {}).get(f)
    need(isinstance(values, torch.Tensor) and values.dim() >= 1 and isinstance(offsets, torch.Tensor))
    need(offsets.dtype == torch.int64 and offsets.shape == (n + 1,))
    need(int(offsets[0]) == 0 and int(offsets[-1]) == values.shape[0] and bool((offsets.diff() >= 0).all()))
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _read_partition(folder: Path, part: dict[str, Any]) -> _Rows:
    where = folder / part["listing"]
    try:
        body = _unpack((folder / part["listing"]).read_bytes())
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise _fail(where, f"cannot be read as msgpack ({e})") from e
    body = body if isinstance(body, dict) else {}
    keys: Any = body.get("keys")
    tags: Any = body.get("tags")
    groups: Any = body.get("groups")
    ok = isinstance(keys, list) and isinstance(tags, list) and isinstance(groups, list)
    if not (ok and len(keys) == len(tags) == part["rows"] and len(groups) == len(part["groups"])):
        raise _fail(where, "its keys, tags and groups are not the manifest's rows")
    try:
        check_keys(keys, allow_empty=True)
    except (InvalidArgument, SchemaError) as e:
        raise _fail(where, f"its keys are not keys a store takes ({e})") from None
    if not all(isinstance(t, dict) and all(isinstance(k, str) for k in t) for t in tags):
        raise _fail(where, "its tags are not dicts with str keys")
    seen: set[int] = set()
    for idx, entry in zip(groups, part["groups"], strict=True):
        if not (isinstance(idx, list) and len(idx) == entry["rows"] and all(type(i) is int for i in idx)):
            raise _fail(where, "a group's rows do not match the manifest")
        if not all(0 <= i < len(keys) for i in idx) or seen.intersection(idx) or len(set(idx)) != len(idx):
            raise _fail(where, "a group names a row that is not there, or one another group holds")
        seen.update(idx)
    out = _Rows(part["id"], keys, tags, [])
    for idx, entry in zip(groups, part["groups"], strict=True):
        tensors: Any = {}
        objects: Any = {}
        if entry["tensors"]:
            try:
                tensors = torch.load(folder / entry["tensors"], weights_only=True, mmap=True)
            except Exception as e:
                raise _fail(folder / entry["tensors"], f"cannot be read as tensors ({e})") from e
        if entry["objects"]:
            try:
                objects = _unpack((folder / entry["objects"]).read_bytes())
            except (OSError, ValueError, msgpack.UnpackException) as e:
                raise _fail(folder / entry["objects"], f"cannot be read as msgpack ({e})") from e
        if not (isinstance(tensors, dict) and all(isinstance(tensors.get(k, {}), dict) for k in _PARTS)):
            raise _fail(folder / entry["tensors"], "does not hold the tensors of a group (dicts of tensors)")
        columns = {
            f: _column(
                folder / entry["objects" if kind == "object" else "tensors"], f, kind, tensors, objects, len(idx)
            )
            for f, kind in entry["fields"].items()
        }
        out.groups.append(([keys[i] for i in idx], columns))
    return out
