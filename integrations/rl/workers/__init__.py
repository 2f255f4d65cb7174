"""Worker glue: the FSDP2/DTensor mixin, a tiny pure-torch causal LM, and a reference worker.

Importing this package imports ``torch.distributed`` and ``dataplane.worker``, nothing heavier.
"""

from integrations.rl.workers.dtensor import DTensorRLWorkerMixin, full_parameters, use_sum_reduction
from integrations.rl.workers.model import TinyCausalLM, TinyConfig, shard_tiny_model, tp_plan
from integrations.rl.workers.tiny import TinyDTensorWorker

__all__ = [
    "DTensorRLWorkerMixin",
    "TinyCausalLM",
    "TinyConfig",
    "TinyDTensorWorker",
    "full_parameters",
    "shard_tiny_model",
    "tp_plan",
    "use_sum_reduction",
]
