"""Rollout engines: what samples completions for the rollout actor, behind one small protocol.

A :class:`RolloutEngine` turns a batch of prompts (token ids) into ``n`` completions each, with the
engine's log-probability of every sampled token, and takes new weights by name. The rollout actor
(:class:`~integrations.rl.rollout_actor.RolloutActor`) needs nothing else of it, so an engine can be
the tiny model's sampler, Hugging Face ``generate``, or an inference server:

* :class:`TorchEngine`: any module with ``step(input_ids, cache) -> (logits, cache)`` (the tiny model,
  :class:`~integrations.rl.workers.hf.CausalLMPolicy`), sampled by :func:`~integrations.rl.rollout.generate`
  with a generator per prompt: a prompt's completions depend only on its seed and the weights;
* :class:`HFEngine`: ``transformers`` ``generate`` on an unsharded copy of the trainers' model, batched
  over every prompt (left-padded) with its KV cache; the log-probs are taken from the logits
  ``generate`` processes, before temperature and top-p (what the trainer computes).

**The log-probs an engine returns** are those of the sampled tokens under ``softmax(logits / T)``
without top-p filtering: the distribution the trainer's ``prev_logprobs`` are computed from, so
``|gen_logprobs - prev_logprobs|`` (reported every step) is ~0 when the weights agree.

**A vLLM or SGLang engine** implements the same three methods (see ``docs/rl/engines.md``):
``generate`` maps to ``LLM.generate(prompts=[TokensPrompt(prompt_token_ids=...)], SamplingParams(n=,
temperature=, top_p=, max_tokens=, stop_token_ids=, seed=, logprobs=0))`` and reads each output's
``token_ids`` and ``logprobs``; ``load_weights`` to ``model.load_weights(weights.items())`` (vLLM fuses
q/k/v and gate/up itself) followed by a prefix-cache reset; ``weight_specs`` to the engine model's names
and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import Tensor, nn

from dataplane import InvalidArgument
from dataplane.checks import check_int, check_number

__all__ = [
    "Completion",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "TorchEngine",
    "as_engine",
    "load_named_weights",
    "weight_specs",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How an engine samples.

    Attributes:
        n: completions per prompt.
        max_new_tokens: the most tokens a completion gets.
        temperature: ``softmax(logits / temperature)``; 0 is greedy decoding.
        top_p: nucleus sampling (1.0: off); the returned log-probs ignore it.
        stop_token_ids: a completion ends after the first of these (it is part of the completion).

    >>> SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(0,)).greedy
    False
    """

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_int("n", self.n, low=1)
        check_int("max_new_tokens", self.max_new_tokens, low=1)
        check_number("temperature", self.temperature, low=0)
        check_number("top_p", self.top_p, low=0, low_open=True, high=1)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: ``[C]`` int64, up to and including the stop token when one was sampled.
        logprobs: ``[C]`` float32, the engine's log-prob of each (see the module docstring).
        finished: whether it ended at a stop token (else at ``max_new_tokens``).
    """

    token_ids: Tensor
    logprobs: Tensor
    finished: bool


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout actor needs of an inference engine."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Completion]]:
        """``params.n`` completions of each prompt (token ids), sampled with the prompt's ``seed``:
        ``out[i][j]`` is completion ``j`` of prompt ``i``."""
        ...

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Take whole parameters by the trainers' names (every parameter the engine has)."""
        ...

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The engine model's parameter names with their shapes and dtypes."""
        ...


def weight_specs(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``name -> (shape, dtype)`` of ``model``'s parameters (what :meth:`RolloutEngine.weight_specs` reports)."""
    return {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}


@torch.no_grad()
def load_named_weights(
    model: nn.Module, weights: Mapping[str, Tensor], *, rename: Callable[[str], str] | None = None
) -> None:
    """Copy whole parameters into ``model`` by name (cast to each parameter's dtype and device).

    ``rename`` maps a trainer's name to the model's (identity by default: the same class on both
    sides). Every parameter must be given and nothing else, else :class:`~dataplane.InvalidArgument`
    and the model is unchanged.
    """
    own = dict(model.named_parameters())
    given = {(rename(k) if rename else k): v for k, v in weights.items()}
    if set(given) != set(own):
        missing, extra = sorted(set(own) - set(given)), sorted(set(given) - set(own))
        raise InvalidArgument(
            f"weights do not fit the rollout model: missing {missing[:5]}, unexpected {extra[:5]}; "
            "sync the trainers' model of the same class, or pass rename="
        )
    for name, p in own.items():
        if tuple(given[name].shape) != tuple(p.shape):
            raise InvalidArgument(
                f"weight {name!r} is {tuple(given[name].shape)}, the rollout model's {tuple(p.shape)}"
            )
    for name, p in own.items():
        p.copy_(given[name].to(device=p.device, dtype=p.dtype))


def _check_batch(prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> None:
    if len(prompts) != len(seeds):
        raise InvalidArgument(f"{len(prompts)} prompts and {len(seeds)} seeds; give one seed per prompt")
    if any(len(p) < 1 for p in prompts):
        raise InvalidArgument("every prompt needs at least one token")


def _completion(tokens: Tensor, logprobs: Tensor, stops: tuple[int, ...]) -> Completion:
    """Cut a row of sampled tokens after its first stop token."""
    ids = tokens.tolist()
    end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
    return Completion(
        token_ids=tokens[:end].to(torch.int64).clone(),
        logprobs=logprobs[:end].to(torch.float32).clone(),
        finished=end < len(ids) or bool(ids and ids[-1] in stops),
    )


class TorchEngine:
    """Samples with any module that has ``step(input_ids, cache) -> (logits, cache)`` (an unsharded
    model on the CPU by default): prompts of one length are batched, each prompt's ``n`` rows drawn
    with a generator of its own seeded from its seed.

    Args:
        model: the module, or a picklable callable that builds it (in a Ray actor).
        device: where it samples.
    """

    def __init__(self, model: nn.Module | Callable[[], nn.Module], *, device: str = "cpu") -> None:
        module = model if isinstance(model, nn.Module) else model()
        if not callable(getattr(module, "step", None)):
            raise InvalidArgument(f"{type(module).__name__} has no step(input_ids, cache); wrap it or use HFEngine")
        self.model = module.to(device)
        self.device = torch.device(device)

    @property
    def vocab_size(self) -> int:
        return int(cast(Any, self.model).vocab_size)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return weight_specs(self.model)

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        load_named_weights(self.model, weights)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Completion]]:
        from integrations.rl.rollout import generate

        _check_batch(prompts, seeds)
        out: list[list[Completion]] = [[] for _ in prompts]
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        for idx in by_len.values():
            batch = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.int64, device=self.device)
            gens = [torch.Generator(device=self.device).manual_seed(int(seeds[i])) for i in idx]
            gen = generate(
                self.model,
                batch.repeat_interleave(params.n, dim=0),
                params.max_new_tokens,
                eos_id=params.stop_token_ids or None,
                temperature=params.temperature,
                top_p=params.top_p,
                generator=gens,
            )
            start = gen.prompt_len
            for k, i in enumerate(idx):
                for j in range(params.n):
                    row = k * params.n + j
                    end = int(gen.lengths[row])
                    out[i].append(
                        Completion(
                            token_ids=gen.tokens[row, start:end].cpu().clone(),
                            logprobs=gen.logprobs[row, start:end].float().cpu().clone(),
                            finished=int(gen.tokens[row, end - 1]) in params.stop_token_ids,
                        )
                    )
        return out


class _LogprobCapture:
    """A ``transformers`` logits processor that records the log-prob of each sampled token under
    ``softmax(logits / T)`` (it runs before the temperature and top-p warpers): one step's
    ``[B, V]`` log-softmax is kept until the next call reads the token sampled from it."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature or 1.0
        self.last: Tensor | None = None
        self.picked: list[Tensor] = []

    def take(self, tokens: Tensor) -> None:
        if self.last is not None:
            self.picked.append(self.last.gather(1, tokens[:, None]).squeeze(1))
            self.last = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self.take(input_ids[:, -1])
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores


class HFEngine:
    """``transformers`` ``generate`` on an unsharded copy of the trainers' model (see the module docstring).

    Args:
        model: the trainers' model class built unsharded (a :class:`~integrations.rl.workers.hf.CausalLMPolicy`,
            whose names are the trainer's; or a plain ``...ForCausalLM``), or a picklable callable that
            builds it.
        pad_token_id: the id prompts are left-padded with (any id: padding is masked out).
        device, dtype: where and in what precision it samples (float32: log-probs that match a float32
            trainer to ~1e-6).
        rename: trainer name -> engine name for :meth:`load_weights` (identity by default).

    Sampling draws from the global RNG (``generate`` takes no generator), seeded inside a forked RNG
    from every prompt's seed: the same prompts, seeds and weights give the same completions, but a
    prompt's completions depend on the whole batch (unlike :class:`TorchEngine` or a vLLM engine with
    per-request seeds).
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        *,
        pad_token_id: int = 0,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        rename: Callable[[str], str] | None = None,
    ) -> None:
        module = model if isinstance(model, nn.Module) else model()
        self.model = module.to(device=device, dtype=dtype).eval()
        self.lm: Any = getattr(module, "lm", module)
        if not callable(getattr(self.lm, "generate", None)):
            raise InvalidArgument(f"{type(self.lm).__name__} has no generate(); HFEngine needs a transformers model")
        self.pad_token_id = int(pad_token_id)
        self.device = torch.device(device)
        self.rename = rename

    @property
    def vocab_size(self) -> int:
        return int(self.lm.get_output_embeddings().weight.shape[0])

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return weight_specs(self.model)

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        load_named_weights(self.model, weights, rename=self.rename)

    def _config(self, params: SamplingParams) -> Any:
        from transformers import GenerationConfig

        sample = not params.greedy
        # every setting explicit: a model's generation_config.json (top_k, repetition_penalty, ...) and
        # transformers' hidden top_k=50 would otherwise change the distribution the log-probs describe
        kw: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p} if sample else {}
        return GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=sample,
            max_new_tokens=params.max_new_tokens,
            top_k=0 if sample else None,
            repetition_penalty=1.0,
            num_beams=1,
            pad_token_id=self.pad_token_id,
            eos_token_id=list(params.stop_token_ids) or None,
            **kw,
        )

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Completion]]:
        _check_batch(prompts, seeds)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, r in enumerate(rows):  # left padding: every row's next token at the same column
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.int64)
            mask[i, width - len(r) :] = 1
        capture = _LogprobCapture(params.temperature)
        seed = hash(tuple(int(s) for s in seeds)) % 2**63
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            seq = self.lm.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=self._config(params),
                logits_processor=[capture],
            )
        new = seq[:, width:].cpu()
        capture.take(seq[:, -1])
        lps = torch.stack(capture.picked, dim=1).cpu() if capture.picked else torch.zeros(len(rows), 0)
        stops = params.stop_token_ids
        flat = [_completion(new[i], lps[i], stops) for i in range(len(rows))]
        return [flat[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]


def as_engine(model: Any) -> RolloutEngine:
    """``model`` as an engine: an engine as is; an ``nn.Module`` (or a callable building an engine or a
    module) in a :class:`TorchEngine`."""
    if isinstance(model, RolloutEngine) and not isinstance(model, nn.Module):
        return model
    built = model if isinstance(model, nn.Module) else model() if callable(model) else None
    if isinstance(built, RolloutEngine) and not isinstance(built, nn.Module):
        return built
    if isinstance(built, nn.Module):
        return TorchEngine(built)
    raise InvalidArgument(
        f"expected a RolloutEngine, an nn.Module with step(), or a callable building one, got {type(model).__name__}"
    )
