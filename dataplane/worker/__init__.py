"""Worker side of the data plane: fetch a shard (independent or leader broadcast), write results back.

>>> import dataplane, torch
>>> from dataplane.worker import DataPlaneWorkerMixin
>>> class Worker(DataPlaneWorkerMixin):
...     pass
>>> w = Worker()
>>> meta = w.setup_data_plane("memory://").kv_batch_put(["a"], {"r": torch.ones(1)}, partition_id="p")
>>> w.fetch(meta, select_fields="r")["r"].tolist()
[1.0]
>>> w.close_data_plane()
"""

from dataplane.worker.descriptor import Descriptor, ErrorInfo, FieldEntry, error_from_info
from dataplane.worker.mesh import DeviceMeshReplicaMixin, is_leader_from_mesh, replica_group_from_mesh
from dataplane.worker.microbatch import iter_microbatches, microbatch_plan
from dataplane.worker.mixin import DataPlaneWorkerMixin, FetchPolicy
from dataplane.worker.stats import FetchStats
from dataplane.worker.writeback import prepare_writeback

__all__ = [
    "DataPlaneWorkerMixin",
    "Descriptor",
    "DeviceMeshReplicaMixin",
    "ErrorInfo",
    "FetchPolicy",
    "FetchStats",
    "FieldEntry",
    "error_from_info",
    "is_leader_from_mesh",
    "iter_microbatches",
    "microbatch_plan",
    "prepare_writeback",
    "replica_group_from_mesh",
]
