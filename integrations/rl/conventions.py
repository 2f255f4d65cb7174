"""Field and tag names of RL batches, and helpers that make model outputs token-aligned.

**Alignment rule.** Every per-token field of a row has the row's length and is aligned to its token:

* ``logprobs[t] = log p(x_t | x_<t)`` (``gen_logprobs``, ``prev_logprobs``, ``ref_logprobs``);
* ``values[t] = V(s_t)``, the value the model predicts *before* seeing token ``t``;
* position 0 holds 0 (nothing predicts the first token), and is never a valid loss position.

A causal model's output at position ``t - 1`` is about token ``t``, so its next-token outputs are
shifted right by one (:func:`shift_to_tokens`, :func:`token_logprobs`) before they are written back.
Because every per-token field then has the row's length, a write-back never fails a length check.

``loss_mask`` is 1 on generated tokens and 0 on the prompt and padding; ``reward`` is one scalar per
row (``[B]``). Rows of one prompt are keyed :func:`row_key` and tagged with ``uid``, ``sample_idx``
and ``weight_version``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor

from dataplane import InvalidArgument
from dataplane.checks import check_int, check_number
from integrations.rl.advantages import right_shift

__all__ = [
    "ADVANTAGES",
    "chunked_token_logprobs",
    "GEN_LOGPROBS",
    "INPUT_IDS",
    "LOSS_MASK",
    "PREV_LOGPROBS",
    "REF_LOGPROBS",
    "RETURNS",
    "REWARD",
    "TAG_SAMPLE_IDX",
    "TAG_UID",
    "TAG_WEIGHT_VERSION",
    "TOKEN_FIELDS",
    "VALUES",
    "row_key",
    "shift_to_tokens",
    "token_logprobs",
    "token_entropy",
    "token_mask",
]

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
GEN_LOGPROBS = "gen_logprobs"
PREV_LOGPROBS = "prev_logprobs"
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
ADVANTAGES = "advantages"
RETURNS = "returns"
REWARD = "reward"

#: Fields with one entry per token (the row's length). ``advantages`` may also be per row (``[B]``).
TOKEN_FIELDS: tuple[str, ...] = (
    INPUT_IDS,
    LOSS_MASK,
    GEN_LOGPROBS,
    PREV_LOGPROBS,
    REF_LOGPROBS,
    VALUES,
    ADVANTAGES,
    RETURNS,
)

TAG_UID = "uid"
TAG_SAMPLE_IDX = "sample_idx"
TAG_WEIGHT_VERSION = "weight_version"


def row_key(uid: str, i: int) -> str:
    """The key of the ``i``-th sample of prompt ``uid``.

    >>> row_key("p17", 3)
    'p17_g3'
    """
    return f"{uid}_g{i}"


def shift_to_tokens(next_token_outputs: Tensor) -> Tensor:
    """Token-align next-token outputs: ``out[:, 0] = 0``, ``out[:, t] = x[:, t - 1]`` (dim 1 is time).

    For a right-padded ``[B, T, ...]`` tensor the last position (padding, or the prediction after the
    final token) drops off the end. A jagged nested tensor is shifted per row
    (:func:`integrations.rl.advantages.right_shift`), never across rows.

    Args:
        next_token_outputs: ``[B, T, ...]`` padded, or jagged ``[B, j, ...]``; position ``t`` holds the
            model's output about token ``t + 1`` (e.g. a value head's ``V(s_{t+1})``).

    Returns:
        A tensor of the same shape, dtype and layout.

    Example:
        >>> import torch
        >>> shift_to_tokens(torch.tensor([[1.0, 2.0, 3.0]]))
        tensor([[0., 1., 2.]])
    """
    x = next_token_outputs
    if not isinstance(x, Tensor):
        raise InvalidArgument(f"next_token_outputs must be a tensor [B, T, ...], got {type(x).__name__}")
    if x.is_nested:
        return right_shift(x)
    if x.dim() < 2:
        raise InvalidArgument(
            f"next_token_outputs must be [B, T, ...] with time on dim 1, got shape {tuple(x.shape)}; "
            "add a batch dimension with x.unsqueeze(0)"
        )
    out = torch.zeros_like(x)
    out[:, 1:] = x[:, :-1]
    return out


def token_logprobs(logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Token-aligned log-probabilities of ``input_ids`` under ``logits``, in float32.

    ``out[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]`` for ``t >= 1`` and
    ``out[:, 0] = 0``. Computed as the gathered logit minus a logsumexp, so no second ``[B, T, V]``
    tensor of log-probabilities is built (beyond a float32 copy of low-precision logits).
    Positions past a row's end hold whatever the padding logits give; mask them with ``loss_mask``.

    Args:
        logits: ``[B, T, V]`` next-token logits of a causal model.
        input_ids: ``[B, T]`` integer token ids.
        temperature: the sampling temperature the tokens were generated with; must be > 0.

    Returns:
        ``[B, T]`` float32.

    Example:
        >>> import torch
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
        >>> token_logprobs(logits, torch.tensor([[2, 0, 3]])).exp()
        tensor([[1.0000, 0.2500, 0.2500]])
    """
    if not isinstance(logits, Tensor) or logits.is_nested or logits.dim() != 3 or not logits.is_floating_point():
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise InvalidArgument(f"logits must be a floating point tensor [B, T, V], got {got}")
    b, t, _ = logits.shape
    if not isinstance(input_ids, Tensor) or input_ids.is_nested or tuple(input_ids.shape) != (b, t):
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise InvalidArgument(f"input_ids must be an integer tensor [B, T] = {(b, t)} matching logits, got {got}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise InvalidArgument(f"input_ids must hold integer token ids, got {input_ids.dtype}; use input_ids.long()")
    check_number("temperature", temperature, low=0, low_open=True)
    out = torch.zeros(b, t, dtype=torch.float32, device=logits.device)
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, input_ids[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    return torch.cat([out[:, :1], picked - scaled.logsumexp(-1)], dim=1)


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    input_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    bias: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`token_logprobs` of ``hidden @ weight.T``, never holding more than ``chunk_tokens`` rows
    of ``[*, V]`` logits: the output layer runs on one chunk of token positions at a time, in float32,
    and the backward recomputes each chunk's logits (``torch.utils.checkpoint``) instead of keeping them.

    For a vocabulary of 151,936 a 16k-token microbatch's float32 logits alone are ~10 GB; here the
    peak is one chunk's (``chunk_tokens * V * 4`` bytes: 0.6 GB at 1,024).

    Args:
        hidden: ``[B, T, H]`` last hidden states (after the final norm), any float dtype.
        weight: ``[V, H]`` the output layer's weight (``lm_head.weight``).
        input_ids: ``[B, T]`` integer token ids.
        temperature: the sampling temperature the tokens were generated with; must be > 0.
        chunk_tokens: token positions per chunk, >= 1.
        with_entropy: also return the entropy of each position's next-token distribution (at
            ``temperature``), token-aligned like the log-probs and computed from the same chunk of
            logits (a metric: it carries no gradient).
        bias: ``[V]`` the output layer's bias, if it has one.

    Returns:
        ``[B, T]`` float32, position 0 holding 0; differentiable in ``hidden`` and ``weight``; with
        ``with_entropy``, the pair ``(logprobs, entropy)``.

    Example:
        >>> import torch
        >>> h, w, ids = torch.randn(2, 5, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 5))
        >>> torch.allclose(chunked_token_logprobs(h, w, ids, chunk_tokens=3), token_logprobs(h @ w.T, ids), atol=1e-6)
        True
    """
    if not isinstance(hidden, Tensor) or hidden.is_nested or hidden.dim() != 3 or not hidden.is_floating_point():
        got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise InvalidArgument(f"hidden must be a floating point tensor [B, T, H], got {got}")
    b, t, h = hidden.shape
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != h:
        got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise InvalidArgument(f"weight must be the output layer's [V, H={h}] weight, got {got}")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise InvalidArgument(f"bias must be the output layer's [V={weight.shape[0]}] bias or None, got {got}")
    if not isinstance(input_ids, Tensor) or input_ids.is_nested or tuple(input_ids.shape) != (b, t):
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise InvalidArgument(f"input_ids must be an integer tensor [B, T] = {(b, t)} matching hidden, got {got}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise InvalidArgument(f"input_ids must hold integer token ids, got {input_ids.dtype}; use input_ids.long()")
    temperature = check_number("temperature", temperature, low=0, low_open=True)
    chunk = check_int("chunk_tokens", chunk_tokens, low=1)
    first = torch.zeros(b, 1, dtype=torch.float32, device=hidden.device)
    if t < 2 or b == 0:  # nothing to predict: zeros, still in the graph (an FSDP2 backward must reach every unit)
        lp = hidden[..., 0].float() * 0 + weight.sum().float() * 0
        return (lp, lp.detach().clone()) if with_entropy else lp
    states = hidden[:, :-1].reshape(-1, h)  # position t-1 predicts token t
    targets = input_ids[:, 1:].reshape(-1).long()
    # Checkpoint only where a backward will come: a forward-only pass keeps nothing anyway.
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    parts: list[Tensor] = []
    entropies: list[Tensor] = []
    for i in range(0, states.shape[0], chunk):
        args = (states[i : i + chunk], targets[i : i + chunk], weight, bias, temperature, with_entropy)
        lp, ent = (
            torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            if grad
            else _chunk_logprobs(*args)
        )
        parts.append(lp)
        if ent is not None:
            entropies.append(ent)
    logprobs = torch.cat([first, torch.cat(parts).view(b, t - 1)], dim=1)
    if not with_entropy:
        return logprobs
    return logprobs, torch.cat([first, torch.cat(entropies).view(b, t - 1)], dim=1)


def _chunk_logprobs(
    states: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    logits = (states @ weight.T if bias is None else torch.addmm(bias, states, weight.T)).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = logits.logsumexp(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # H = lse - sum(p * logits); a metric, no gradient
            entropy = lse.detach() - (logits.detach().softmax(-1) * logits.detach()).sum(-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, entropy


def token_entropy(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Token-aligned entropy ``[B, T]`` (float32, no gradient) of the next-token distributions of
    ``logits [B, T, V]`` at ``temperature``: ``out[:, t]`` is that of the distribution token ``t`` was
    drawn from; position 0 holds 0 (see :func:`token_logprobs`).

    >>> import math, torch
    >>> abs(float(token_entropy(torch.zeros(1, 2, 4))[0, 1]) - math.log(4)) < 1e-6
    True
    """
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise InvalidArgument(f"logits must be a floating point tensor [B, T, V], got {got}")
    check_number("temperature", temperature, low=0, low_open=True)
    with torch.no_grad():
        scaled = logits[:, :-1].float() / temperature
        ent = scaled.logsumexp(-1) - (scaled.softmax(-1) * scaled).sum(-1)
        return torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)


def token_mask(lengths: Sequence[int] | Tensor, width: int) -> Tensor:
    """A ``[B, width]`` bool mask, True where ``t < lengths[b]`` (the row's real tokens).

    Args:
        lengths: ``B`` row lengths, each in ``[0, width]``.
        width: the padded length ``T``.

    Example:
        >>> token_mask([2, 0, 3], 3)
        tensor([[ True,  True, False],
                [False, False, False],
                [ True,  True,  True]])
    """
    check_int("width", width, low=0)
    lens = lengths if isinstance(lengths, Tensor) else torch.as_tensor(list(lengths), dtype=torch.int64)
    if lens.dim() != 1 or lens.is_floating_point() or lens.dtype == torch.bool:
        raise InvalidArgument(f"lengths must be a 1-D sequence of ints, got shape {tuple(lens.shape)} {lens.dtype}")
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > width):
        raise InvalidArgument(f"lengths must lie in [0, width={width}], got {lens.tolist()}; pass a larger width")
    return torch.arange(width, device=lens.device) < lens[:, None]
