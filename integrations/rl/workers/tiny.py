"""A reference FSDP2 worker for the tiny model: what a user's worker looks like, runnable on a CPU.

On every rank of an initialised process group (gloo on CPU, NCCL on GPUs)::

    worker = TinyDTensorWorker(TinyConfig(), tp=2, lr=1e-3)
    worker.setup_data_plane(url)
    worker.get_logprobs_presharded(shard_meta)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from dataplane import InvalidArgument
from dataplane.checks import check_int
from integrations.rl.optim import build_optimizer
from integrations.rl.workers.dtensor import DTensorRLWorkerMixin
from integrations.rl.workers.model import TinyCausalLM, TinyConfig, shard_tiny_model

__all__ = ["TinyDTensorWorker"]


class TinyDTensorWorker(DTensorRLWorkerMixin):
    """A :class:`TinyCausalLM` on a ``("dp", "tp")`` mesh over every rank, with its optimizer.

    Build it on every rank of an initialised process group; every rank must pass the same arguments
    (the weights come from ``seed``, so all ranks start from the same model).

    Args:
        config: the model's shape (``head="value"`` for a critic).
        tp: tensor-parallel size (divides the world size and ``config.n_heads``); DP = world / tp.
        optimizer: ``"adamw"`` or ``"sgd"`` (plain SGD: parameters move linearly in the gradient,
            which is what parity tests of the step compare best).
        lr, weight_decay, betas: optimizer settings (``betas`` for AdamW only).
        max_grad_norm: clip bound of the split step (None: measure only).
        seed: initial weights.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; the current device).
        value_shift: see :class:`~integrations.rl.workers.dtensor.DTensorRLWorkerMixin` (an ablation switch).

    Log-probs come from the model's chunked path (``chunked_logprobs``), and a policy's train step
    reports its ``entropy``, as for the Hugging Face worker.
    """

    chunked_logprobs = True

    def __init__(
        self,
        config: TinyConfig | None = None,
        *,
        tp: int = 1,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
        seed: int = 0,
        device: str = "cpu",
        value_shift: bool = True,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise InvalidArgument("initialise torch.distributed (init_process_group) on every rank before the worker")
        world = dist.get_world_size()
        check_int("tp", tp, low=1, allow_numpy=True)
        if world % tp:
            raise InvalidArgument(f"tp={tp} must be >= 1 and divide the world size {world}")
        self.config = config or TinyConfig()
        self.device_mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = TinyCausalLM(self.config)
        if device != "cpu":
            model = model.to(device)
        self.model = shard_tiny_model(model, self.device_mesh)
        self.optimizer = build_optimizer(
            self.model.parameters(), name=optimizer, lr=lr, weight_decay=weight_decay, betas=betas
        )
        self.max_grad_norm = max_grad_norm
        self.value_shift = value_shift
        self.report_entropy = self.config.head == "lm"

    def state(self) -> dict[str, Any]:
        """Whole parameters and optimizer state on the CPU (a collective: call on every rank)."""
        from torch.distributed.tensor import DTensor

        from integrations.rl.workers.dtensor import full_parameters

        def whole(t: Any) -> Any:
            if isinstance(t, DTensor):
                return t.full_tensor().cpu().clone()
            return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t

        names = {id(p): n for n, p in self.model.named_parameters()}
        opt = {
            names[id(p)]: {k: whole(v) for k, v in sorted(self.optimizer.state[p].items())}
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p in self.optimizer.state
        }
        return {"params": full_parameters(self.model), "optimizer": opt, "version": self.weight_version}
