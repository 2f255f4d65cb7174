"""Sampling from the tiny model and a toy task with a verifiable reward (groundwork for the GRPO flow).

:func:`generate` samples responses with a KV cache and returns token-aligned ``gen_logprobs`` (the
same numbers a full forward gives, so a trainer's first ratio is 1). :class:`CountingTask` is a
task the tiny model learns in a few dozen steps: keep counting from where the prompt stops.

>>> import torch
>>> from integrations.rl.workers.model import TinyCausalLM, TinyConfig
>>> task = CountingTask(vocab_size=16, prompt_len=3, target_len=4)
>>> g = torch.Generator().manual_seed(0)
>>> prompts = task.prompts(2, generator=g)
>>> out = generate(TinyCausalLM(TinyConfig(vocab_size=16)), prompts, 6, eos_id=task.eos_id, generator=g)
>>> out.tokens.shape, bool((out.lengths <= 9).all())
(torch.Size([2, 9]), True)
>>> task.reward([5, 6, 7], [8, 9, 10, 11])
1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dataplane import InvalidArgument
from dataplane.checks import check_int, check_number

__all__ = ["CountingTask", "Generation", "Prompt", "generate"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A task's prompt, as the rollout engine gets it and the reward sees it.

    Attributes:
        token_ids: the prompt's tokens.
        text: the prompt as text (a text task), else None.
        answer: the reference answer the reward compares with, if any.
    """

    token_ids: tuple[int, ...]
    text: str | None = None
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    """What :func:`generate` returns; rows are right-padded with 0 after their length.

    Attributes:
        tokens: ``[B, P + N]`` prompt and response tokens.
        logprobs: ``[B, P + N]`` token-aligned logprobs of the sampled tokens (0 on the prompt and padding).
        lengths: ``[B]`` row lengths (prompt + response up to and including EOS).
        prompt_len: ``P``.
    """

    tokens: Tensor
    logprobs: Tensor
    lengths: Tensor
    prompt_len: int

    def loss_mask(self) -> Tensor:
        """``[B, P + N]`` int64: 1 on generated tokens within each row's length."""
        pos = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return ((pos >= self.prompt_len) & (pos < self.lengths[:, None])).long()


@torch.no_grad()
def generate(
    model: Any,
    prompts: Tensor,
    max_new_tokens: int,
    *,
    eos_id: int | Sequence[int] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> Generation:
    """Sample ``max_new_tokens`` after each prompt (all prompts ``P`` long), stopping rows at ``eos_id``.

    ``model`` is a :class:`~integrations.rl.workers.model.TinyCausalLM` or any module with its
    ``step(input_ids, cache) -> (logits, cache)`` (:class:`~integrations.rl.workers.hf.CausalLMPolicy`).

    Sampling is from ``softmax(logits / temperature)`` with ``generator`` (same seed, same weights:
    same tokens), restricted to the smallest set of tokens whose probability reaches ``top_p`` when
    ``top_p < 1``; ``temperature=0`` is greedy. The returned logprobs are those of the sampled tokens
    under ``softmax(logits / temperature)`` (``temperature`` 1 when greedy), before any top-p cut.
    ``eos_id`` is one stop token or several.
    A sequence of ``k`` generators splits the rows into ``k`` equal consecutive blocks (groups), each
    sampled with its own: a block's samples are then what generating it alone would give, up to the
    batched forward's rounding (its logprobs may differ in the last bit, and a token only where that
    moves a sampling boundary).
    """
    if prompts.dim() != 2 or prompts.shape[1] < 1 or prompts.dtype != torch.int64:
        raise InvalidArgument(f"prompts must be int64 [B, P] with P >= 1, got {prompts.dtype} {tuple(prompts.shape)}")
    check_int("max_new_tokens", max_new_tokens, low=1, allow_numpy=True)
    check_number("temperature", temperature, low=0)
    check_number("top_p", top_p, low=0, low_open=True, high=1)
    stops = torch.tensor([] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id))
    was_training = model.training
    model.eval()
    try:
        b, p = prompts.shape
        gens = list(generator) if isinstance(generator, Sequence) else [generator]
        if not gens or b % len(gens):
            raise InvalidArgument(f"{len(gens)} generators for {b} rows; give one per equal block of rows")
        block = b // len(gens)
        logits, cache = model.step(prompts)
        tokens, logprobs = [prompts], [torch.zeros(b, p)]
        done = torch.zeros(b, dtype=torch.bool)
        lengths = torch.full((b,), p + max_new_tokens, dtype=torch.int64)
        for i in range(max_new_tokens):
            lp = torch.log_softmax(logits[:, -1].float() / (temperature or 1.0), dim=-1)
            if temperature == 0:
                nxt = lp.argmax(dim=-1)
            else:
                probs = lp.exp() if top_p >= 1 else _nucleus(lp.exp(), top_p)
                nxt = torch.cat(
                    [torch.multinomial(probs[k * block : (k + 1) * block], 1, generator=g) for k, g in enumerate(gens)]
                ).squeeze(1)
            nxt = torch.where(done, torch.zeros_like(nxt), nxt)
            tokens.append(nxt[:, None])
            logprobs.append(torch.where(done, 0.0, lp.gather(1, nxt[:, None]).squeeze(1))[:, None])
            if stops.numel():
                ended = ~done & torch.isin(nxt, stops.to(nxt.device))
                lengths[ended] = p + i + 1
                done |= ended
            if bool(done.all()) or i == max_new_tokens - 1:
                break
            logits, cache = model.step(nxt[:, None], cache)
        out = torch.cat(tokens, dim=1)
        lps = torch.cat(logprobs, dim=1)
        width = out.shape[1]
        if width < p + max_new_tokens:  # every row ended early: pad to the full width
            pad = p + max_new_tokens - width
            out = torch.cat([out, out.new_zeros(b, pad)], dim=1)
            lps = torch.cat([lps, lps.new_zeros(b, pad)], dim=1)
        return Generation(tokens=out, logprobs=lps, lengths=lengths, prompt_len=p)
    finally:
        model.train(was_training)


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """``probs`` with every token outside the smallest set reaching ``top_p`` set to 0 (per row)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # the mass before a token already reaches top_p
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class CountingTask:
    """Continue counting: the prompt is ``prompt_len`` consecutive tokens (cycling through
    ``1..vocab_size-1``); the reward is the fraction of the first ``target_len`` response tokens that
    keep counting, up to the first miss or EOS (token 0), so 1.0 is a perfect continuation.
    """

    vocab_size: int = 16
    prompt_len: int = 4
    target_len: int = 4
    eos_id: int = 0

    def __post_init__(self) -> None:
        for name, low in (("vocab_size", 3), ("prompt_len", 1), ("target_len", 1)):
            check_int(f"CountingTask.{name}", getattr(self, name), low=low)
        if self.eos_id != 0:
            raise InvalidArgument(
                f"CountingTask counts through 1..vocab_size-1 and ends at token 0; eos_id must be 0, got {self.eos_id!r}"
            )

    def _next(self, tok: int) -> int:
        return tok % (self.vocab_size - 1) + 1

    def prompts(self, n: int, *, generator: torch.Generator | None = None) -> Tensor:
        """``[n, prompt_len]`` int64 prompts with random starts."""
        starts = torch.randint(1, self.vocab_size, (n,), generator=generator)
        steps = torch.arange(self.prompt_len)
        return ((starts[:, None] - 1 + steps) % (self.vocab_size - 1) + 1).long()

    def reward(self, prompt: list[int], response: list[int]) -> float:
        """Fraction of the first ``target_len`` response tokens that continue the count."""
        expect, good = prompt[-1], 0
        for tok in response[: self.target_len]:
            expect = self._next(expect)
            if tok != expect:
                break
            good += 1
        return good / self.target_len

    # -- the Task protocol (integrations.rl.tasks.Task) --------------------------------------------
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def prompt(self, generator: torch.Generator) -> Prompt:
        """A training prompt drawn with ``generator``."""
        return Prompt(token_ids=tuple(self.prompts(1, generator=generator)[0].tolist()))

    def eval_prompts(self, n: int) -> list[Prompt]:
        """``n`` held-out prompts: every start in turn (the task has ``vocab_size - 1`` distinct prompts)."""
        starts = [1 + i % (self.vocab_size - 1) for i in range(check_int("n", n, low=0))]
        return [
            Prompt(token_ids=tuple((s - 1 + k) % (self.vocab_size - 1) + 1 for k in range(self.prompt_len)))
            for s in starts
        ]

    def score(self, prompt: Prompt, completion: Sequence[int]) -> float:
        """:meth:`reward` of a completion (token ids, the stop token included or not)."""
        return self.reward(list(prompt.token_ids), list(completion))

    def rewards(self, gen: Generation) -> Tensor:
        """``[B]`` float32 rewards of a :class:`Generation` (responses cut at each row's length)."""
        out = []
        for row, length in zip(gen.tokens.tolist(), gen.lengths.tolist(), strict=True):
            out.append(self.reward(row[: gen.prompt_len], row[gen.prompt_len : length]))
        return torch.tensor(out, dtype=torch.float32)
