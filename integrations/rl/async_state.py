"""What an asynchronous GRPO checkpoint holds besides the trainers' state: the replay buffer's
committed groups (their rows as a core snapshot, :mod:`dataplane.snapshot`; their slots as JSON) and
the controller's counters, so a resumed controller issues, trains and reports as the run that was
never stopped.

A checkpoint is taken with no rollout in flight (the controller drains them first): every slot is
committed, and the snapshot holds exactly the buffer's partition.

>>> import torch
>>> from dataplane import KVBatchMeta
>>> meta = KVBatchMeta(partition_id="p", keys=("s1p1_g0",))
>>> slot = Slot(3, "s1p1", 0, ["s1p1_g0"], "committed", meta, {"rewards": torch.ones(1)})
>>> back = slot_from_json(slot_to_json(slot))
>>> (back.id, back.uid, back.meta.keys, back.info["rewards"].tolist(), back.state)
(3, 's1p1', ('s1p1_g0',), [1.0], 'committed')
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import torch

from dataplane import DataPlaneClient, DataPlaneError, KVBatchMeta
from dataplane.snapshot import load_snapshot, save_snapshot
from integrations.rl.replay import Slot

__all__ = ["BUFFER_DIR", "load_buffer_rows", "save_buffer_rows", "slot_from_json", "slot_to_json"]

#: The step directory's folder of the buffer's rows (a core snapshot).
BUFFER_DIR = "buffer"


def slot_to_json(slot: Slot) -> dict[str, Any]:
    """A committed slot as JSON: its id, uid, weights, keys, meta (msgpack, base64) and per-row rewards."""
    if slot.state != "committed" or slot.meta is None:
        raise DataPlaneError(f"slot {slot.uid!r} is {slot.state}: only committed slots are saved")
    rewards = slot.info.get("rewards")
    return {
        "id": slot.id,
        "uid": slot.uid,
        "weight_version": slot.weight_version,
        "keys": list(slot.keys),
        "meta": base64.b64encode(slot.meta.to_msgpack()).decode("ascii"),
        "rewards": None if rewards is None else [float(r) for r in rewards.tolist()],  # float32 -> float is exact
    }


def slot_from_json(doc: dict[str, Any]) -> Slot:
    """The committed slot :func:`slot_to_json` wrote (its meta unstamped: see the comment below)."""
    info: dict[str, Any] = {}
    if doc.get("rewards") is not None:
        info["rewards"] = torch.tensor(doc["rewards"], dtype=torch.float32)
    # the rows were loaded into another deployment (the saved one may be gone): the meta's stamp of
    # where they were written is dropped, so a client of the deployment they are in now reads them
    saved = KVBatchMeta.from_msgpack(base64.b64decode(doc["meta"])).to_dict()
    meta = KVBatchMeta.from_dict({**saved, "deployment": "", "deployment_url": ""})
    return Slot(int(doc["id"]), str(doc["uid"]), int(doc["weight_version"]), list(doc["keys"]), "committed", meta, info)


def save_buffer_rows(client: DataPlaneClient, directory: Path, partition_id: str) -> dict[str, Any]:
    """Snapshot the buffer's partition into ``directory / BUFFER_DIR``; its rows and bytes."""
    info = save_snapshot(client, directory / BUFFER_DIR, [partition_id])
    return {"rows": sum(info.partitions.values()), "bytes": info.nbytes}


def load_buffer_rows(client: DataPlaneClient, directory: Path, partition_id: str) -> int:
    """Load the buffer's rows saved in ``directory`` into the (emptied) partition; how many."""
    info = load_snapshot(client, directory / BUFFER_DIR, [partition_id], replace=True)
    return int(sum(info.partitions.values()))
