"""Worker glue: the presharded RL calls (:class:`RLWorkerMixin`), the FSDP2/DTensor mixin, a tiny
pure-torch causal LM and a reference worker; the Megatron mixin is
:mod:`integrations.rl.workers.megatron` (imported on its own: it needs megatron-core and CUDA), with
its tiny model in :mod:`~integrations.rl.workers.megatron_tiny` and its weight map to the rollout
side in :mod:`~integrations.rl.workers.megatron_weights`. What a trainer actor builds from
factories: :mod:`~integrations.rl.workers.build` and :mod:`~integrations.rl.workers.layout`.

Importing this package imports ``torch.distributed`` and ``dataplane.worker``, nothing heavier.
"""

from integrations.rl.workers.base import RLWorkerMixin, eval_mode
from integrations.rl.workers.dtensor import DTensorRLWorkerMixin, full_parameters, use_sum_reduction
from integrations.rl.workers.model import TinyCausalLM, TinyConfig, shard_tiny_model, tp_plan
from integrations.rl.workers.tiny import TinyDTensorWorker

__all__ = [
    "DTensorRLWorkerMixin",
    "RLWorkerMixin",
    "TinyCausalLM",
    "TinyConfig",
    "TinyDTensorWorker",
    "eval_mode",
    "full_parameters",
    "shard_tiny_model",
    "tp_plan",
    "use_sum_reduction",
]
