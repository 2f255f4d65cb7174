"""Checkpoints of what a dataplane deployment holds, as plain files that outlive it.

A Mooncake deployment's rows die with the process that lent their memory, so a verl checkpoint
must copy them out. :func:`save` writes every partition (its keys in listing order, their tags, and
each field's rows) to a directory; :func:`load` replaces what the deployment holds with it. No
pickle: tensors go through ``torch.save`` of plain tensors (read back with ``weights_only=True``),
tags, keys and object columns through msgpack, the manifest through JSON. The directory is swapped
in atomically (written to ``<dir>.tmp``; the previous one kept as ``<dir>.old`` until the new one is
in place, and rolled back from there if a save died between the two renames).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import torch

from dataplane import DataPlaneClient

__all__ = ["FORMAT", "load", "save"]

FORMAT = "dataplane-verl-checkpoint/1"
MANIFEST = "metadata.json"


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _save_group(client: DataPlaneClient, pid: str, keys: list[str], fields: list[str], path: Path) -> dict[str, str]:
    """One group of rows sharing ``fields``: tensors to ``<path>.pt``, objects to ``<path>.objects``."""
    got = client.kv_batch_get(keys, select_fields=fields, partition_id=pid)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, list[Any]] = {}
    kinds: dict[str, str] = {}
    for f in fields:
        v = got.get(f)
        if isinstance(v, torch.Tensor) and v.is_nested:
            tensors[f"{f}/values"], tensors[f"{f}/offsets"] = v.values().contiguous(), v.offsets()  # type: ignore[attr-defined]
            kinds[f] = "jagged"
        elif isinstance(v, torch.Tensor):
            tensors[f] = v.contiguous()
            kinds[f] = "dense"
        else:
            objects[f] = list(v.tolist()) if hasattr(v, "tolist") else list(v)
            kinds[f] = "object"
    if tensors:
        torch.save(tensors, path.with_suffix(".pt"))
    if objects:
        path.with_suffix(".objects").write_bytes(_pack(objects))
    return kinds


def save(client: DataPlaneClient, directory: str | os.PathLike[str], *, metadata: Any = None) -> Path:
    """Write every partition ``client``'s deployment holds to ``directory`` (replacing it atomically).

    Returns the directory. ``metadata`` (JSON-serialisable) is kept in the manifest as
    ``user_metadata``.

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
    final = Path(directory)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    partitions = []
    for i, (pid, rows) in enumerate(client.kv_list().items()):
        keys = list(rows)
        info = client.kv_describe(keys, partition_id=pid) if keys else {}
        groups: dict[frozenset[str], list[str]] = {}
        for k in keys:
            if k in info and info[k].fields:
                groups.setdefault(info[k].fields, []).append(k)
        entries = []
        for j, (fields, members) in enumerate(groups.items()):
            name = f"p{i}_g{j}"
            kinds = _save_group(client, pid, members, sorted(fields), tmp / name)
            entries.append({"file": name, "fields": kinds})
            (tmp / f"{name}.keys").write_bytes(_pack(members))
        (tmp / f"p{i}.rows").write_bytes(_pack({"keys": keys, "tags": [rows[k] for k in keys]}))
        partitions.append({"partition_id": pid, "rows": f"p{i}.rows", "groups": entries})
    manifest = {"format": FORMAT, "partitions": partitions, "user_metadata": metadata}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _columns(directory: Path, entry: dict[str, Any]) -> dict[str, Any]:
    name, kinds = entry["file"], entry["fields"]
    tensors = (
        torch.load(directory / f"{name}.pt", weights_only=True) if any(k != "object" for k in kinds.values()) else {}
    )
    objects = _unpack((directory / f"{name}.objects").read_bytes()) if "object" in kinds.values() else {}
    out: dict[str, Any] = {}
    for f, kind in kinds.items():
        if kind == "jagged":
            out[f] = torch.nested.nested_tensor_from_jagged(tensors[f"{f}/values"], tensors[f"{f}/offsets"])
        elif kind == "dense":
            out[f] = tensors[f]
        else:
            out[f] = objects[f]
    return out


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a checkpoint (rolling back a save that died between its renames)."""
    final = Path(directory)
    old = final.with_name(final.name + ".old")
    if not final.exists() and old.exists():
        old.rename(final)
    path = final / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{final} holds no dataplane checkpoint ({MANIFEST} missing)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{final} is a {manifest.get('format')!r} checkpoint; this reads {FORMAT!r}")
    return dict(manifest)


def load(client: DataPlaneClient, directory: str | os.PathLike[str], *, replace: Sequence[str] | None = None) -> Any:
    """Make ``client``'s deployment hold what :func:`save` wrote to ``directory``: every partition it
    holds now (or only ``replace``) is cleared first, then each saved partition's rows are put back in
    their listing order with their tags and fields. Returns the saved ``user_metadata``."""
    final = Path(directory)
    manifest = read_manifest(final)
    for pid in client.kv_list() if replace is None else replace:
        client.kv_clear(partition_id=pid)
    for part in manifest["partitions"]:
        pid = part["partition_id"]
        rows = _unpack((final / part["rows"]).read_bytes())
        if rows["keys"]:  # every row first, tags and order as saved (fields may come in several groups)
            client.kv_batch_put(rows["keys"], None, partition_id=pid, tags=rows["tags"])
        for entry in part["groups"]:
            keys = _unpack((final / f"{entry['file']}.keys").read_bytes())
            client.kv_batch_put(keys, _columns(final, entry), partition_id=pid)
    return manifest.get("user_metadata")
