"""A Megatron model's whole parameters, under the names a rollout model loads them by.

A weight sync from Megatron trainers to a rollout engine takes two steps:

1. :func:`gather_megatron_parameters` (a collective on every rank of the model): each tensor-parallel
   parameter's shards concatenated along its ``partition_dim`` (a gated MLP's ``linear_fc1`` shards,
   ``[gate_r; up_r]`` each, regrouped into ``[gate; up]``), each pipeline stage's layers renumbered
   from local to global (``layer_number - 1``) and the stages gathered over the pipeline group:
   ``{Megatron name: whole CPU tensor}``, the same on every rank, as a TP = PP = 1 model names them.
2. A :class:`NameMap` renames them: one small table of Megatron names (``{i}`` for the global layer)
   to the rollout model's names, with the few reshapes a fused layout needs (:class:`QKV` splits
   Megatron's per-group ``[q, k, v]`` rows into three projections, :class:`Gated` splits a gated
   ``linear_fc1`` into gate and up). The map is strict: a Megatron parameter the table does not place
   is an error (it would silently not reach the rollout), and a rollout parameter nothing fills is an
   error unless it is a bias, which becomes zeros (a Megatron model without biases). Rows beyond the
   rollout model's (a vocabulary padded for TP) are cut.

:data:`TINY_GPT` is the table of the tiny model (:class:`~integrations.rl.workers.model.TinyCausalLM`,
the examples' rollout model); the table for Hugging Face Llama / Qwen2 names is in ``docs/rl/megatron.md``.

Pure torch: megatron-core is imported only inside :func:`gather_megatron_parameters`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dataplane import InvalidArgument

__all__ = [
    "TINY_GPT",
    "Gated",
    "NameMap",
    "QKV",
    "Zero",
    "gather_megatron_parameters",
    "load_megatron_parameters",
    "megatron_shapes",
    "tiny_name_map",
]


@dataclass(frozen=True, slots=True)
class QKV:
    """Megatron's fused ``linear_qkv`` (``[groups * (q_per_group + 2) * head_dim, hidden]``, per query
    group its query heads, then one key and one value head) into the three rollout projections."""

    q: str
    k: str
    v: str

    def fuse(self, q: Tensor, k: Tensor, v: Tensor, heads: int, groups: int, head_dim: int) -> Tensor:
        """The inverse of :meth:`split`: three projections into Megatron's fused rows."""
        per = heads // groups
        rest = tuple(q.shape[1:])
        parts = (q.reshape(groups, per * head_dim, *rest), k.reshape(groups, head_dim, *rest))
        return torch.cat([*parts, v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)

    def split(self, t: Tensor, heads: int, groups: int, head_dim: int) -> dict[str, Tensor]:
        per = heads // groups
        x = t.reshape(groups, (per + 2) * head_dim, *t.shape[1:])
        q, k, v = torch.split(x, [per * head_dim, head_dim, head_dim], dim=1)
        flat = (groups * per * head_dim, *t.shape[1:])
        return {
            self.q: q.reshape(flat),
            self.k: k.reshape(groups * head_dim, *t.shape[1:]),
            self.v: v.reshape(groups * head_dim, *t.shape[1:]),
        }


@dataclass(frozen=True, slots=True)
class Gated:
    """A gated MLP's ``linear_fc1`` (``[gate; up]`` along rows) into the gate and up projections."""

    gate: str
    up: str

    def split(self, t: Tensor) -> dict[str, Tensor]:
        gate, up = t.chunk(2, dim=0)
        return {self.gate: gate, self.up: up}

    def fuse(self, gate: Tensor, up: Tensor) -> Tensor:
        return torch.cat([gate, up], dim=0)


@dataclass(frozen=True, slots=True)
class Zero:
    """A Megatron parameter the rollout model has no place for, held at zero (a bias the rollout model
    lacks, frozen): exported only after checking it is still zero, imported as zeros."""


Target = str | QKV | Gated | Zero

#: Megatron GPT (local layer spec, learned absolute positions) ->
#: :class:`~integrations.rl.workers.model.TinyCausalLM`; ``{i}`` is the global layer index. The tiny
#: model's attention has no biases: Megatron's (``add_bias_linear=True``) are held at zero
#: (:class:`Zero`); without ``add_bias_linear`` the tiny model's MLP biases are sent as zeros.
TINY_GPT: dict[str, Target] = {
    "embedding.word_embeddings.weight": "embed.weight",
    "embedding.position_embeddings.weight": "pos.weight",
    "decoder.layers.{i}.input_layernorm.weight": "blocks.{i}.norm1.weight",
    "decoder.layers.{i}.input_layernorm.bias": "blocks.{i}.norm1.bias",
    "decoder.layers.{i}.self_attention.linear_qkv.weight": QKV(
        "blocks.{i}.attn.q.weight", "blocks.{i}.attn.k.weight", "blocks.{i}.attn.v.weight"
    ),
    "decoder.layers.{i}.self_attention.linear_qkv.bias": Zero(),
    "decoder.layers.{i}.self_attention.linear_proj.weight": "blocks.{i}.attn.o.weight",
    "decoder.layers.{i}.self_attention.linear_proj.bias": Zero(),
    "decoder.layers.{i}.pre_mlp_layernorm.weight": "blocks.{i}.norm2.weight",
    "decoder.layers.{i}.pre_mlp_layernorm.bias": "blocks.{i}.norm2.bias",
    "decoder.layers.{i}.mlp.linear_fc1.weight": "blocks.{i}.up.weight",
    "decoder.layers.{i}.mlp.linear_fc1.bias": "blocks.{i}.up.bias",
    "decoder.layers.{i}.mlp.linear_fc2.weight": "blocks.{i}.down.weight",
    "decoder.layers.{i}.mlp.linear_fc2.bias": "blocks.{i}.down.bias",
    "decoder.final_layernorm.weight": "norm.weight",
    "decoder.final_layernorm.bias": "norm.bias",
    "output_layer.weight": "head.weight",
    "output_layer.linear.weight": "head.weight",  # a value head (a plain Linear in place of the output layer)
    "output_layer.linear.bias": "head.bias",
}


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(re.escape(key).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


@dataclass(frozen=True, slots=True, kw_only=True)
class NameMap:
    """Megatron names -> a rollout model's names (see the module docstring).

    Attributes:
        table: Megatron name (``{i}``: global layer index) -> the rollout name, or a :class:`QKV` /
            :class:`Gated` split into several.
        targets: the rollout model's parameters in its order, name -> shape (what it loads). None: take
            whatever the table produces, in Megatron's order, with no zeros and no checks of shape.
    """

    table: Mapping[str, Target]
    targets: Mapping[str, tuple[int, ...]] | None = None

    def apply(self, params: Mapping[str, Tensor], *, heads: int, groups: int, head_dim: int) -> dict[str, Tensor]:
        """Rename (and split) ``params`` (:func:`gather_megatron_parameters`'s output).

        Args:
            heads, groups, head_dim: the model's attention heads, query groups (= ``heads`` without
                GQA) and head width, for :class:`QKV`.

        Raises:
            InvalidArgument: a Megatron parameter the table has no entry for, a rollout parameter
                (not a bias) nothing fills, or a shape the rollout model does not have.
        """
        patterns = [(_pattern(k), v) for k, v in self.table.items()]
        out: dict[str, Tensor] = {}
        unplaced = []
        for name, t in params.items():
            for pattern, target in patterns:
                m = pattern.match(name)
                if m is None:
                    continue
                layer = m.groupdict().get("i") or ""
                if isinstance(target, Zero):
                    if t.numel() and float(t.abs().max()) != 0.0:
                        raise InvalidArgument(
                            f"Megatron's {name} is not zero, and the rollout model has no place for it: "
                            "freeze it at zero (requires_grad_(False)), or give the name map a target for it"
                        )
                    pieces = {}
                elif isinstance(target, QKV):
                    pieces = target.split(t, heads, groups, head_dim)
                elif isinstance(target, Gated):
                    pieces = target.split(t)
                else:
                    pieces = {target: t}
                for key, value in pieces.items():
                    out[key.replace("{i}", layer)] = value.contiguous()
                break
            else:
                unplaced.append(name)
        if unplaced:
            raise InvalidArgument(
                f"the name map places no rollout parameter for Megatron's {unplaced[:6]}"
                f"{' ...' if len(unplaced) > 6 else ''}: add them to its table (a model with biases or layers "
                "the rollout model lacks does not fit it)"
            )
        return out if self.targets is None else self._fit(out)

    def to_megatron(
        self,
        params: Mapping[str, Tensor],
        *,
        heads: int,
        groups: int,
        head_dim: int,
        shapes: Mapping[str, tuple[int, ...]],
    ) -> dict[str, Tensor]:
        """The inverse of :meth:`apply`: rollout-named whole tensors (a checkpoint of the rollout model,
        or its initial weights) to the Megatron names of ``shapes`` (name -> whole shape, as
        :func:`megatron_shapes` gives them for one stage). :class:`Zero` entries come out as zeros,
        rows a padded vocabulary has beyond the rollout model's as zeros too.

        Raises:
            InvalidArgument: a Megatron name the table has no entry for, a rollout parameter it needs
                that ``params`` lacks, or a shape that does not fit.
        """
        patterns = [(_pattern(k), v) for k, v in self.table.items()]
        out: dict[str, Tensor] = {}
        for name, shape in shapes.items():
            for pattern, target in patterns:
                m = pattern.match(name)
                if m is None:
                    continue
                layer = m.groupdict().get("i") or ""

                def get(key: str, layer: str = layer, name: str = name) -> Tensor:
                    key = key.replace("{i}", layer)
                    if key not in params:
                        raise InvalidArgument(f"Megatron's {name} needs the rollout model's {key}, which is not given")
                    return params[key].detach()

                if isinstance(target, Zero):
                    t = torch.zeros(shape)
                elif isinstance(target, QKV):
                    t = target.fuse(get(target.q), get(target.k), get(target.v), heads, groups, head_dim)
                elif isinstance(target, Gated):
                    t = target.fuse(get(target.gate), get(target.up))
                else:
                    t = get(target)
                if t.dim() >= 1 and t.shape[0] < shape[0] and tuple(t.shape[1:]) == tuple(shape[1:]):
                    t = torch.cat([t, t.new_zeros(shape[0] - t.shape[0], *t.shape[1:])])  # a padded vocabulary
                if tuple(t.shape) != tuple(shape):
                    raise InvalidArgument(
                        f"{name}: Megatron has {tuple(shape)}, the rollout weights give {tuple(t.shape)}"
                    )
                out[name] = t
                break
            else:
                raise InvalidArgument(f"the name map has no entry for Megatron's {name}: add it to its table")
        return out

    def _fit(self, out: dict[str, Tensor]) -> dict[str, Tensor]:
        assert self.targets is not None
        extra = sorted(set(out) - set(self.targets))
        missing = [n for n in self.targets if n not in out and not n.endswith(".bias")]
        if extra or missing:
            raise InvalidArgument(
                f"the mapped weights do not fit the rollout model: unexpected {extra[:6]}, missing {missing[:6]}; "
                "fix the name map's table"
            )
        fitted: dict[str, Tensor] = {}
        for name, shape in self.targets.items():
            t = out.get(name)
            if t is None:  # a bias the Megatron model does not have
                fitted[name] = torch.zeros(shape)
                continue
            if t.dim() >= 1 and t.shape[0] > shape[0] and tuple(t.shape[1:]) == tuple(shape[1:]):
                t = t[: shape[0]]  # a vocabulary padded to divide by TP: the rollout model's rows only
            if tuple(t.shape) != tuple(shape):
                raise InvalidArgument(f"{name}: Megatron gives {tuple(t.shape)}, the rollout model has {tuple(shape)}")
            fitted[name] = t
        return fitted


def tiny_name_map(config: Any) -> NameMap:
    """:data:`TINY_GPT` with the shapes of a :class:`~integrations.rl.workers.model.TinyCausalLM` of
    ``config`` (a :class:`~integrations.rl.workers.model.TinyConfig`).

    >>> from integrations.rl.workers.model import TinyConfig
    >>> list(tiny_name_map(TinyConfig(n_layers=1)).targets)[:3]
    ['embed.weight', 'pos.weight', 'blocks.0.norm1.weight']
    """
    from integrations.rl.workers.model import TinyCausalLM

    with torch.device("meta"):
        model = TinyCausalLM(config)
    return NameMap(table=TINY_GPT, targets={n: tuple(p.shape) for n, p in model.named_parameters()})


# -- gathering -------------------------------------------------------------------------------------
def _unwrap(model: Any) -> Any:
    """The GPT module under Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``)."""
    for _ in range(8):
        inner = getattr(model, "module", None)
        if inner is None:
            return model
        model = inner
    return model


_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<i>\d+)\.")
_LAYER_MODULE = re.compile(r"(?:.*\.)?layers\.\d+")


def _global_layer_names(module: Any) -> Callable[[str], str]:
    """A renamer of this stage's parameter names: local layer ``j`` -> global ``layer_number - 1``."""
    numbers: dict[str, int] = {}
    for name, m in module.named_modules():
        if _LAYER_MODULE.fullmatch(name) and hasattr(m, "layer_number"):
            numbers[name] = int(m.layer_number) - 1

    def rename(name: str) -> str:
        m = _LAYER.match(name)
        if m is None:
            return name
        key = m.group("prefix") + m.group("i")
        if key not in numbers:
            return name
        return f"{m.group('prefix')}{numbers[key]}.{name[m.end() :]}"

    return rename


def _shard(t: Tensor, dim: int, tp: int, rank: int, gated: bool) -> Tensor:
    """This TP rank's shard of a whole tensor (a gated ``linear_fc1``: its slice of gate and of up)."""
    if gated:
        gate, up = t.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return t.chunk(tp, dim=dim)[rank]


def _gated_fc1(model: Any) -> Callable[[str], bool]:
    from megatron.core.utils import get_model_config

    gated = bool(getattr(get_model_config(model), "gated_linear_unit", False))
    return lambda name: gated and re.search(r"mlp\.linear_fc1\.(weight|bias)$", name) is not None


def megatron_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """This rank's parameters by their TP = PP = 1 names, with their whole (TP-gathered) shapes."""
    from megatron.core import parallel_state as ps

    module = _unwrap(model)
    tp = ps.get_tensor_model_parallel_world_size()
    rename = _global_layer_names(module)
    out: dict[str, tuple[int, ...]] = {}
    for name, p in module.named_parameters():
        shape = list(p.shape)
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            shape[int(p.partition_dim)] *= tp
        out[rename(name)] = tuple(shape)
    return out


def load_megatron_parameters(model: Any, whole: Mapping[str, Tensor]) -> None:
    """Copy whole parameters (TP = PP = 1 names, as :func:`gather_megatron_parameters` returns them)
    into this rank's shards: each rank takes its TP slice of each tensor-parallel parameter and its
    stage's layers. No collective. A mixed-precision optimizer keeps its own copies: call its
    ``reload_model_params()`` after (``MegatronRLWorkerMixin.import_weights`` does)."""
    from megatron.core import parallel_state as ps

    module = _unwrap(model)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    rename, gated = _global_layer_names(module), _gated_fc1(model)
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = rename(name)
            if key not in whole:
                raise InvalidArgument(f"no weights for Megatron's {key}")
            t = whole[key]
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                t = _shard(t, int(p.partition_dim), tp, rank, gated(name))
            if tuple(t.shape) != tuple(p.shape):
                raise InvalidArgument(f"{key}: this rank holds {tuple(p.shape)}, the weights give {tuple(t.shape)}")
            p.copy_(t.to(device=p.device, dtype=p.dtype))


def gather_megatron_parameters(model: Any) -> dict[str, Tensor]:
    """Every parameter of a Megatron model whole, on the CPU, by its TP = PP = 1 name (see the module
    docstring). A collective: call it on every rank of the model; every rank gets the same dict.

    Tensor-parallel shards are all-gathered over the TP group (``tensor_model_parallel`` parameters, by
    their ``partition_dim``); pipeline stages are all-gathered as objects over the PP group, so it suits
    models whose whole weights fit in host memory (a large model streams them instead).
    """
    from megatron.core import parallel_state as ps

    module = _unwrap(model)
    tp = ps.get_tensor_model_parallel_world_size()
    rename, gated = _global_layer_names(module), _gated_fc1(model)
    stage: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        if ".experts." in name:
            raise InvalidArgument(f"{name}: expert (MoE) parameters are not gathered yet; export them yourself")
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            dim = int(p.partition_dim)
            if gated(name):
                halves = [x.chunk(2, dim=dim) for x in parts]
                t = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
            else:
                t = torch.cat(parts, dim=dim)
        stage[rename(name)] = t.to(device="cpu", copy=True)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stage
    boxes: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(boxes, stage, group=ps.get_pipeline_model_parallel_group())
    whole: dict[str, Tensor] = {}
    for part in boxes:
        whole.update(part)
    return whole
