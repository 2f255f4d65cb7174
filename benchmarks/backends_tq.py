"""TransferQueue entries of ``benchmarks.put_get``: ``tq-simple`` and ``tq-mooncake``.

Each has a ``raw`` ceiling: TransferQueue's own ``kv_batch_put`` / ``kv_batch_get`` on the same batch
(a TensorDict of the batch's tensors, jagged fields as jagged nested tensors), through the
TransferQueue the benchmark's dataplane client started, so the table shows ours against raw.
Raw gets return dense fields as nested tensors; the figure includes no densifying, ours does.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.backends import BenchBackend, RawTimes
from benchmarks.workload import Batch

__all__ = ["BACKENDS"]


def raw_seconds(batch: Batch, repeat: int, client: Any = None, warmup: int = 1) -> RawTimes:
    """Median-able put/get seconds of ``transfer_queue.kv_batch_put/kv_batch_get`` on ``batch``."""
    import transfer_queue as tq
    from tensordict import TensorDict

    tensors = {k: v for k, v in batch.fields.items() if isinstance(v, torch.Tensor)}
    data = TensorDict(tensors, batch_size=[len(batch.keys)])
    names = list(tensors)
    puts, gets = [], []
    for i in range(warmup + repeat):
        pid = f"bench-raw-{i}"
        t0 = time.perf_counter()
        tq.kv_batch_put(keys=batch.keys, partition_id=pid, fields=data)
        t1 = time.perf_counter()
        out = tq.kv_batch_get(keys=batch.keys, partition_id=pid, select_fields=names)
        t2 = time.perf_counter()
        if out.batch_size[0] != len(batch.keys):
            raise RuntimeError("raw TransferQueue get returned the wrong number of rows")
        del out
        tq.get_client().clear_partition(pid)
        if i >= warmup:
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    return RawTimes(get=gets, put={"tensors": puts})


def reader_url(client: Any) -> tuple[str, dict[str, Any]]:
    """Reader processes join the benchmark's Ray cluster and attach to its TransferQueue."""
    import ray

    return "tq://", {"ray_address": ray.get_runtime_context().gcs_address}


def own_master() -> tuple[dict[str, Any], Any]:
    """A ``mooncake_master`` for ``tq-mooncake``, started while other backends run (it takes ~3 s to
    settle); TransferQueue joins it (``master=``) and the benchmark stops it after the client."""
    from dataplane.adapters.mooncake import start_master

    master = start_master()
    return {"master": master.address}, master.stop


TQ_PATHS = (
    "puts from ordinary tensors against TransferQueue's own kv_batch_put of the same tensors; TransferQueue "
    "serialises every put, so client.empty() is torch.empty (no copy-free path)"
)

BACKENDS: list[BenchBackend] = [
    BenchBackend(
        name="tq-simple",
        url="tq://?backend=simple&timeout_s=600",
        requires=("transfer_queue", "ray"),
        paths=TQ_PATHS,
        raw=raw_seconds,
        reader_url=reader_url,
    ),
    BenchBackend(
        name="tq-mooncake",
        url=f"tq://?backend=mooncake&timeout_s=600&segment_bytes={4 << 30}",
        requires=("transfer_queue", "ray", "mooncake"),
        paths=TQ_PATHS,
        raw=raw_seconds,
        reader_url=reader_url,
        prepare=own_master,
    ),
]
