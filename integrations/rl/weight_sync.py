"""Moving a trainer group's weights to the rollout side after each step, behind one small interface.

A :class:`WeightSync` is any object with ``push(policy, rollout, version)``. The default,
:class:`ObjectStoreWeightSync`, has rank 0 gather the whole parameters into Ray's object store and
the rollout actor load them from there (the driver passes a ref and never holds the tensors): right
for small models and for tests.

What is sent is each trainer worker's
:meth:`~integrations.rl.workers.base.RLWorkerMixin.export_weights`: whole parameters under the names
the rollout model loads. An FSDP2 / DTensor worker gathers its shards and keeps its model's names; a
Megatron worker gathers its tensor-parallel shards and pipeline stages and renames them through its
``rollout_names`` (:mod:`integrations.rl.workers.megatron_weights`: Megatron's fused QKV split into
q, k, v, a padded vocabulary cut), so a Megatron policy syncs into a rollout model of another layout. A user with a large model plugs in a sync over NCCL (a process group
between the trainers and the inference engine) or the engine's own weight-update API::

    class EngineSync:
        def push(self, policy, rollout, version):
            policy.broadcast_to_engine(...)      # your collective
            ray.get(rollout.update_weights_done.remote(version), timeout=300)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from integrations.rl.policy import Policy, gather

__all__ = ["ObjectStoreWeightSync", "WeightSync"]


@runtime_checkable
class WeightSync(Protocol):
    """Push the policy's current weights to the rollout actor, which then samples as ``version``."""

    def push(self, policy: Policy, rollout: Any, version: int) -> None: ...


class ObjectStoreWeightSync:
    """Whole parameters through Ray's object store: ``policy.state_dict_ref()`` then
    ``rollout.load_weights(params, version)``; bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s

    def push(self, policy: Policy, rollout: Any, version: int) -> None:
        ref = policy.state_dict_ref()
        gather(
            [rollout.load_weights.remote(ref, version)], timeout_s=self.timeout_s, what="weight sync", names=["rollout"]
        )
