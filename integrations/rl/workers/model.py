"""A tiny pure-torch causal LM for tests and examples, and how to shard it (FSDP2, optional TP).

Nothing is downloaded and ``transformers`` is never imported: the model builds in milliseconds, so
every flow and example runs on a laptop CPU. It is also the reference for the small interface a
user's own model needs (see :class:`~integrations.rl.workers.dtensor.DTensorRLWorkerMixin`):
``input_ids [B, T] -> logits [B, T, V]`` for a policy, ``-> values [B, T]`` for a critic, where
position ``t`` has seen tokens ``0..t`` (causal) and rows are right-padded (padding never reaches
earlier positions, so no attention mask is needed).

>>> import torch
>>> model = TinyCausalLM(TinyConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2))
>>> model(torch.zeros(2, 5, dtype=torch.long)).shape
torch.Size([2, 5, 16])
>>> TinyCausalLM(TinyConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, head="value"))(torch.zeros(2, 5, dtype=torch.long)).shape
torch.Size([2, 5])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dataplane import InvalidArgument
from dataplane.checks import check_int
from integrations.rl.conventions import chunked_token_logprobs
from integrations.rl.workers.dtensor import use_sum_reduction

__all__ = ["TinyCausalLM", "TinyConfig", "shard_tiny_model", "tp_plan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyConfig:
    """Shape of a :class:`TinyCausalLM`.

    Attributes:
        vocab_size: token ids are ``0..vocab_size-1``.
        dim: model width (divisible by ``n_heads``).
        n_layers: transformer blocks.
        n_heads: attention heads (divisible by the tensor-parallel size).
        max_len: longest row the position embedding covers.
        head: ``"lm"`` (logits over the vocabulary) or ``"value"`` (one value per position).
    """

    vocab_size: int = 32
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 256
    head: Literal["lm", "value"] = "lm"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_len"):
            check_int(f"TinyConfig.{name}", getattr(self, name), low=1)
        if self.dim % self.n_heads:
            raise InvalidArgument(f"TinyConfig.dim={self.dim} must divide by n_heads={self.n_heads}")
        if self.head not in ("lm", "value"):
            raise InvalidArgument(f"TinyConfig.head must be 'lm' or 'value', got {self.head!r}")


class _Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        # Separate projections (not one fused qkv) so column-wise TP splits whole heads.
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # Under TP each rank holds n_heads / tp heads: count them from the local projection width.
        q, k, v = (
            y.view(b, t, y.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)
            for y in (p(x) for p in (self.q, self.k, self.v))
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, q.shape[1] * self.head_dim))  # type: ignore[no-any-return]

    def step(self, x: Tensor, past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Attend ``x`` (new positions) to ``past`` keys/values and itself; return the output and the cache."""
        b, t, _ = x.shape
        q, k, v = (
            y.view(b, t, y.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)
            for y in (p(x) for p in (self.q, self.k, self.v))
        )
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        # New positions see every cached one and, among themselves, the earlier ones.
        s = k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, t, q.shape[1] * self.head_dim)), (k, v)


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = _Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))  # type: ignore[no-any-return]

    def step(self, x: Tensor, past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        a, cache = self.attn.step(self.norm1(x), past)
        x = x + a
        return x + self.down(F.gelu(self.up(self.norm2(x)))), cache


class TinyCausalLM(nn.Module):
    """Embedding, learned positions, ``n_layers`` pre-norm transformer blocks, a final norm, a head.

    ``forward(input_ids [B, T]) -> logits [B, T, vocab_size]`` (``head="lm"``) or ``values [B, T]``
    (``head="value"``). Works for ``B == 0``, which is what a dummy microbatch is.
    """

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_len, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size if cfg.head == "lm" else 1, bias=cfg.head == "value")

    def forward(
        self,
        input_ids: Tensor,
        *,
        output: Literal["logits", "logprobs"] = "logits",
        temperature: float = 1.0,
        entropy: bool = False,
        chunk_tokens: int = 1024,
    ) -> Any:
        """Logits ``[B, T, V]`` (values ``[B, T]`` for a value head), or with ``output="logprobs"``
        the token-aligned log-probs of ``input_ids`` computed one chunk of logits at a time
        (:func:`~integrations.rl.conventions.chunked_token_logprobs`; with ``entropy``, the pair with
        the entropies): the path the RL workers train on."""
        t = int(input_ids.shape[1])
        if t > self.cfg.max_len:
            raise InvalidArgument(f"rows of {t} tokens exceed TinyConfig.max_len={self.cfg.max_len}; raise max_len")
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        if output == "logprobs":
            if self.cfg.head != "lm":
                raise InvalidArgument("output='logprobs' needs a TinyConfig(head='lm') model")
            return chunked_token_logprobs(
                self.norm(x),
                self.head.weight,
                input_ids,
                temperature=temperature,
                chunk_tokens=chunk_tokens,
                with_entropy=entropy,
                bias=self.head.bias,
            )
        if output != "logits":
            raise InvalidArgument(f"output must be 'logits' or 'logprobs', got {output!r}")
        out = self.head(self.norm(x))
        # a value head's [B, T, 1] as [B, T]: a copy, not a view (FSDP2 warns about returning views)
        return out.squeeze(-1).clone() if self.cfg.head == "value" else out

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def step(self, input_ids: Tensor, cache: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list[Any]]:
        """Incremental forward for generation (an unsharded model): ``input_ids`` are the positions after
        the ``cache``'s; returns their outputs (as :meth:`forward` would) and the extended cache."""
        start = 0 if cache is None else int(cache[0][0].shape[2])
        t = int(input_ids.shape[1])
        if start + t > self.cfg.max_len:
            raise InvalidArgument(f"{start + t} positions exceed TinyConfig.max_len={self.cfg.max_len}; raise max_len")
        x = self.embed(input_ids) + self.pos(torch.arange(start, start + t, device=input_ids.device))
        new: list[Any] = []
        for i, block in enumerate(self.blocks):
            assert isinstance(block, _Block)
            x, kv = block.step(x, None if cache is None else cache[i])
            new.append(kv)
        out = self.head(self.norm(x))
        return (out.squeeze(-1) if self.cfg.head == "value" else out), new


def tp_plan(model: TinyCausalLM) -> dict[str, Any]:
    """Megatron-style TP plan of the blocks: q/k/v and ``up`` column-wise, ``o`` and ``down`` row-wise.

    Embeddings, norms and the head stay whole on every TP rank (FSDP still shards them over DP), so
    the logits come out as a plain replicated tensor.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def shard_tiny_model(model: TinyCausalLM, mesh: Any) -> TinyCausalLM:
    """Shard ``model`` in place on a named ``DeviceMesh``: TP over ``"tp"`` (when the mesh has it,
    size > 1), then FSDP2 over ``"dp"`` per block and at the root, with sum reduction.

    Call it on every rank with the same initial weights (seed before building the model).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "dp" not in names:
        raise InvalidArgument(f"the mesh needs a 'dp' dim (and optionally 'tp'), got dims {names}")
    if "tp" in names and mesh["tp"].size() > 1:
        tp = int(mesh["tp"].size())
        if model.cfg.n_heads % tp:
            raise InvalidArgument(f"n_heads={model.cfg.n_heads} must divide by the TP size {tp}")
        parallelize_module(model, mesh["tp"], tp_plan(model))
    dp_mesh = mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    use_sum_reduction(model)
    return model
