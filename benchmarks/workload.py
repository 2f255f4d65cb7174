"""RL-rollout-shaped batches for the benchmarks: token ids, log-probs, advantages, masks, scalars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from dataplane.codec import materialize, offsets_from_lengths

__all__ = ["Batch", "in_client_memory", "make_batch", "rollout_lengths"]

# (name, dtype) of the per-token fields, cycled to reach the requested field count
_TOKEN_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("input_ids", torch.int64),
    ("old_logprobs", torch.bfloat16),
    ("advantages", torch.float32),
    ("loss_mask", torch.bool),
)


def rollout_lengths(n: int, mean: float, rng: np.random.Generator, max_len: int | None = None) -> np.ndarray:
    """Long-tailed lengths like real rollouts: lognormal (sigma 0.8), at least 1, scaled to ``mean``."""
    raw = rng.lognormal(mean=0.0, sigma=0.8, size=n)
    lens = np.maximum(1, np.round(raw / raw.mean() * mean)).astype(np.int64)
    if max_len is not None:
        lens = np.minimum(lens, max_len)
    return lens


@dataclass
class Batch:
    keys: list[str]
    fields: dict[str, Any]
    payload_bytes: int  # bytes of tensor data as they travel (values only for jagged)
    padded_bytes: int  # bytes the same data would take padded to the longest row
    lengths: np.ndarray


def make_batch(
    total_bytes: int,
    n_fields: int,
    *,
    layout: Literal["jagged", "padded"] = "jagged",
    rows: int | None = None,
    objects: bool = False,
    seed: int = 0,
) -> Batch:
    """About ``total_bytes`` of rollout data in ``n_fields`` fields (per-token fields, plus one [B]
    reward scalar once there are 4 or more fields)."""
    rng = np.random.default_rng(seed)
    b = rows or (64 if total_bytes < (8 << 20) else 256)
    n_scalar = 1 if n_fields >= 4 else 0
    token_specs = [_TOKEN_FIELDS[i % len(_TOKEN_FIELDS)] for i in range(n_fields - n_scalar)]
    bytes_per_token = sum(torch.empty((), dtype=d).element_size() for _, d in token_specs)
    tokens = max(b, total_bytes // bytes_per_token)
    lens = rollout_lengths(b, tokens / b, rng)
    lens[-1] += max(0, tokens - int(lens.sum()))  # hit the byte target exactly
    offsets = offsets_from_lengths(torch.from_numpy(lens))
    g = torch.Generator().manual_seed(seed)
    fields: dict[str, Any] = {}
    payload = padded = 0
    width = int(lens.max())
    for i, (name, dtype) in enumerate(token_specs):
        n = int(lens.sum())
        if dtype is torch.bool:
            values = torch.rand(n, generator=g) > 0.1
        elif dtype is torch.int64:
            values = torch.randint(0, 150_000, (n,), generator=g)
        else:
            values = torch.randn(n, generator=g).to(dtype)
        key = name if i < len(_TOKEN_FIELDS) else f"{name}_{i}"
        padded += b * width * values.element_size()
        if layout == "padded":
            dense = materialize(values, offsets)
            fields[key] = dense
            payload += dense.numel() * dense.element_size()
        else:
            fields[key] = torch.nested.nested_tensor_from_jagged(values, offsets)
            payload += values.numel() * values.element_size()
    if n_scalar:
        fields["reward"] = torch.randn(b, generator=g)
        payload += b * 4
        padded += b * 4
    if objects:
        fields["messages"] = [
            {"role": "assistant", "turn": i, "text": "x" * int(rng.integers(5, 50))} for i in range(b)
        ]
    keys = [f"uid{i // 8}_g{i % 8}" for i in range(b)]
    return Batch(keys=keys, fields=fields, payload_bytes=payload, padded_bytes=padded, lengths=lens)


def in_client_memory(batch: Batch, client: Any) -> Batch:
    """The same batch, built in ``client.empty`` memory (what a put sends without a staging copy)."""
    fields: dict[str, Any] = {}
    for name, v in batch.fields.items():
        if not isinstance(v, torch.Tensor):
            fields[name] = v
            continue
        src = v.values() if v.is_nested else v
        dst = client.empty(tuple(src.shape), src.dtype)
        dst.copy_(src)
        fields[name] = torch.nested.nested_tensor_from_jagged(dst, v.offsets()) if v.is_nested else dst
    return Batch(batch.keys, fields, batch.payload_bytes, batch.padded_bytes, batch.lengths)


def flat_views(batch: Batch) -> list[torch.Tensor]:
    """The batch's tensor bytes as flat uint8 views, for the memcpy ceiling."""
    out = []
    for v in batch.fields.values():
        if isinstance(v, torch.Tensor):
            t = v.values() if v.is_nested else v
            out.append(t.contiguous().reshape(-1).view(torch.uint8))
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"  # pragma: no cover


def same_fields(got: Any, want: dict[str, Any]) -> bool:
    """Whether every field of ``want`` (tensors only) is bit-exact in ``got`` (jagged: values and offsets)."""
    from dataplane.testing.strategies import bit_exact

    ok = True
    for f, v in want.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"same_fields compares tensor fields; {f!r} is {type(v).__name__}")
        if v.is_nested:
            ok &= bit_exact(got[f].values(), v.values()) and torch.equal(got[f].offsets(), v.offsets())
        else:
            ok &= bit_exact(got[f], v)
    return ok
