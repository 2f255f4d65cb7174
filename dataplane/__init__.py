"""dataplane: a pluggable data plane for distributed RL post-training.

Move rollout tensors between rollout workers, the driver and training ranks through an existing
distributed store; the driver only holds a small :class:`KVBatchMeta`.

>>> import dataplane, torch
>>> with dataplane.connect() as client:
...     meta = client.kv_batch_put(["a", "b"], {"reward": torch.tensor([1.0, 0.0])}, partition_id="train")
...     client.kv_batch_get(meta, select_fields=["reward"])["reward"].tolist()
[1.0, 0.0]
"""

from dataplane.claims import ConsumptionStatus
from dataplane.client import Capabilities, DataPlaneClient
from dataplane.errors import (
    BackendUnavailable,
    CapacityExceeded,
    ClientClosed,
    DataPlaneError,
    DataPlaneTimeout,
    DeploymentMismatch,
    InvalidArgument,
    KeyNotFound,
    SchemaError,
    SnapshotConflict,
    SnapshotError,
    SnapshotNotFound,
)
from dataplane.meta import KVBatchMeta, RowInfo
from dataplane.registry import available_adapters, connect, register_adapter
from dataplane.streaming import ClaimStream, stream

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "Capabilities",
    "CapacityExceeded",
    "ClaimStream",
    "ClientClosed",
    "ConsumptionStatus",
    "DataPlaneClient",
    "DataPlaneError",
    "DataPlaneTimeout",
    "DeploymentMismatch",
    "InvalidArgument",
    "KVBatchMeta",
    "RowInfo",
    "KeyNotFound",
    "SchemaError",
    "SnapshotConflict",
    "SnapshotError",
    "SnapshotNotFound",
    "available_adapters",
    "connect",
    "register_adapter",
    "stream",
]
