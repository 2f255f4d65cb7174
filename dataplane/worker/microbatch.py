"""Microbatches of a fetched shard, as the driver planned them.

The preshard step stores each rank's plan in ``meta.extra_info["microbatches"]``: a list of lists of
row positions within the shard, with the same number of microbatches on every DP rank (unequal counts
deadlock the first cross-DP collective). Workers follow the plan and never re-pack locally.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from tensordict import TensorDictBase

from dataplane.errors import InvalidArgument
from dataplane.meta import KVBatchMeta

__all__ = ["iter_microbatches", "microbatch_plan"]


def microbatch_plan(meta: KVBatchMeta) -> list[list[int]] | None:
    """The validated plan in ``meta.extra_info["microbatches"]``, or None when there is none.

    >>> m = KVBatchMeta(partition_id="p", keys=["a", "b", "c"], extra_info={"microbatches": [[0, 1], [2]]})
    >>> microbatch_plan(m)
    [[0, 1], [2]]
    """
    plan = meta.extra_info.get("microbatches")
    if plan is None:
        return None
    if not isinstance(plan, Sequence) or not all(isinstance(mb, Sequence) for mb in plan):
        raise InvalidArgument(
            "extra_info['microbatches'] must be a list of lists of row positions; use the metas the preshard step made"
        )
    out = [[int(i) for i in mb] for mb in plan]
    bad = [i for mb in out for i in mb if not 0 <= i < meta.size]
    if bad:
        raise InvalidArgument(
            f"extra_info['microbatches'] names row {bad[0]} of a shard of {meta.size} rows; the plan belongs to "
            "another shard -- pass the meta the preshard step made for this rank"
        )
    return out


def iter_microbatches(
    data: TensorDictBase, meta: KVBatchMeta, *, micro_batch_size: int | None = None
) -> Iterator[TensorDictBase]:
    """Yield the microbatches of ``data`` (a fetch of ``meta``) in plan order.

    With no plan in the meta, yields consecutive chunks of ``micro_batch_size`` rows, or the whole
    batch once. Consecutive positions give views; others give copies.

    Args:
        data: what :meth:`DataPlaneWorkerMixin.fetch` returned for ``meta``.
        meta: the shard meta carrying the plan.
        micro_batch_size: rows per microbatch when the meta has no plan.

    >>> from tensordict import TensorDict
    >>> m = KVBatchMeta(partition_id="p", keys=["a", "b", "c"], extra_info={"microbatches": [[2], [0, 1]]})
    >>> td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    >>> [mb["x"].tolist() for mb in iter_microbatches(td, m)]
    [[2], [0, 1]]
    """
    rows = int(data.batch_size[0]) if data.batch_dims else 0
    if rows != meta.size:
        raise InvalidArgument(f"data has {rows} rows but the meta has {meta.size}; pass the meta that was fetched")
    plan = microbatch_plan(meta)
    if plan is None:
        if micro_batch_size is None:
            yield data
            return
        if micro_batch_size < 1:
            raise InvalidArgument(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        for start in range(0, rows, micro_batch_size):
            yield data[start : start + micro_batch_size]
        return
    for mb in plan:
        if not mb:
            yield data[0:0]
        elif mb == list(range(mb[0], mb[0] + len(mb))):
            yield data[mb[0] : mb[0] + len(mb)]
        else:
            yield data[torch.tensor(mb, dtype=torch.int64)]
