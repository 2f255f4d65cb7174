"""A worker mixin that trains an FSDP2 / DTensor model from the data plane.

Mix :class:`DTensorRLWorkerMixin` into your training worker (one process per rank)::

    class PolicyWorker(DTensorRLWorkerMixin):
        def __init__(self):
            self.device_mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
            self.model = my_model                 # parallelize_module over "tp", fully_shard over "dp"
            use_sum_reduction(self.model)         # the split step divides by the global count itself
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
            self.setup_data_plane(url)            # every rank

Then the driver hands each rank the shard meta :func:`dataplane.preshard.shard_meta_for_dp` made
for its DP rank (TP/CP siblings get the same one) and calls, on every rank:

* :meth:`~DTensorRLWorkerMixin.get_logprobs_presharded` / :meth:`~DTensorRLWorkerMixin.get_values_presharded`:
  fetch ``input_ids`` (the group's leader reads, its siblings get a broadcast), forward the planned
  microbatches, write token-aligned results back from the leader only;
* :meth:`~DTensorRLWorkerMixin.train_presharded`: fetch the fields the loss reads, run the split
  step (:mod:`integrations.rl.split_step`) over the planned microbatches, return the step's metrics.

Your model's interface is small: :meth:`~DTensorRLWorkerMixin.policy_logits` (``input_ids [B, T] ->
logits [B, T, V]``) and :meth:`~DTensorRLWorkerMixin.value_predictions` (``-> [B, T]``); by default
both call ``self.model(input_ids)``, override them for other signatures (a Hugging Face model:
``self.model(input_ids=ids).logits``). Rows are right-padded and position ``t`` must see only
tokens ``0..t``.

Full logits cost ``[B, T, V]`` floats (10 GB in float32 for 16k tokens of a 152k vocabulary). A
policy model that computes its token log-probs itself, one chunk of logits at a time
(:func:`~integrations.rl.conventions.chunked_token_logprobs` inside its forward, where FSDP2 has its
output layer gathered), says so with ``chunked_logprobs = True`` on the worker; its forward then takes
``(input_ids, *, output="logprobs", temperature=..., entropy=...)`` and returns ``[B, T]`` float32
log-probs (with ``entropy=True``, the pair with the entropies). :class:`~integrations.rl.workers.hf.CausalLMPolicy`
wraps any Hugging Face causal LM that way, and :class:`~integrations.rl.workers.model.TinyCausalLM`
has it built in.

Microbatches follow the plan in ``meta.extra_info["microbatches"]`` and are never re-packed; every
DP rank runs the same number of forwards (the shortest pads with one-row, zero-loss dummies), so no
rank waits in a collective its peers never reach. Context parallelism is the host's: CP ranks are
treated as replicas of their DP rank (same rows; the leader writes), and the host's forward must
shard and gather the sequence itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dataplane import InvalidArgument
from dataplane.worker import DeviceMeshReplicaMixin
from integrations.rl.workers.base import RLWorkerMixin, full_parameters  # full_parameters: also exported here

__all__ = ["DTensorRLWorkerMixin", "full_parameters", "use_sum_reduction"]


def use_sum_reduction(model: nn.Module) -> int:
    """Make every FSDP2 module of ``model`` reduce gradients by plain sum over DP (no averaging).

    The split step divides by the global count itself, so FSDP must not average. Gloo has no
    ``PREMUL_SUM``: ``set_gradient_divide_factor(1.0)`` alone fails on CPU, and
    ``set_force_sum_reduction_for_comms(True)`` makes the collectives plain sums. Both are per
    module, so every FSDP module of the tree gets them.

    Returns:
        how many FSDP modules were set (0 for a model without ``fully_shard``).
    """
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            n += 1
    return n


def _plain(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class DTensorRLWorkerMixin(DeviceMeshReplicaMixin, RLWorkerMixin):
    """RL worker glue for FSDP2 / DTensor models; see the module docstring.

    The host sets ``device_mesh`` (named dims with ``"dp"``; optional ``"tp"``, ``"cp"``),
    ``model``, ``optimizer``, optionally ``lr_scheduler`` and ``max_grad_norm``, and calls
    :meth:`~dataplane.worker.DataPlaneWorkerMixin.setup_data_plane` on every rank.
    The presharded calls and their attributes (``logprob_temperature``, ``value_shift``, microbatch
    sizes) are :class:`~integrations.rl.workers.base.RLWorkerMixin`'s.
    """

    #: the model computes its own token log-probs in chunks (see the module docstring)
    chunked_logprobs: bool = False

    # -- the host's model ------------------------------------------------------------------------
    def compute_device(self) -> torch.device:
        """Where fetched batches go for the forward: the mesh's device type (the current CUDA device)."""
        if self.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_mesh.device_type)

    def policy_logits(self, input_ids: Tensor) -> Tensor:
        """``input_ids [B, T] -> logits [B, T, V]`` (next-token logits at each position)."""
        return _plain(self.model(input_ids))

    def value_predictions(self, input_ids: Tensor) -> Tensor:
        """``input_ids [B, T] -> [B, T]``: at position t, the value after seeing tokens ``0..t``."""
        out = _plain(self.model(input_ids))
        return out.squeeze(-1) if out.dim() == 3 else out

    def token_logprobs_of(self, input_ids: Tensor) -> Tensor:
        """Token-aligned logprobs ``[B, T]``: from the model's own chunked path when
        ``chunked_logprobs``, else from :meth:`policy_logits`."""
        if not self.chunked_logprobs:
            return super().token_logprobs_of(input_ids)
        return _plain(self.model(input_ids, output="logprobs", temperature=self.logprob_temperature))

    def token_logprobs_and_entropy(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        if not self.chunked_logprobs:
            return super().token_logprobs_and_entropy(input_ids)
        lp, ent = self.model(input_ids, output="logprobs", temperature=self.logprob_temperature, entropy=True)
        return _plain(lp), _plain(ent)

    # -- split-step hooks ------------------------------------------------------------------------
    def train_dp_group(self) -> Any | None:
        names = tuple(self.device_mesh.mesh_dim_names or ())
        dims = [d for d in self.data_plane_dp_dims if d in names]
        if not dims:
            raise InvalidArgument(f"the device mesh {names} has none of the DP dims {self.data_plane_dp_dims}")
        if len(dims) > 1:
            return self.device_mesh[tuple(dims)]._flatten().get_group()
        return self.device_mesh.get_group(dims[0])

    def train_world_group(self) -> Any | None:
        if self.device_mesh.size() != dist.get_world_size():
            raise InvalidArgument(
                f"the device mesh spans {self.device_mesh.size()} of {dist.get_world_size()} ranks; override "
                "train_world_group() to return the group of every rank training this model"
            )
        return dist.group.WORLD
