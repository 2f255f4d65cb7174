"""Tasks over text: prompts from a dataset, a tokenizer, and a reward on the decoded completion.

A :class:`Task` is what the rollout actor asks for prompts and scores completions with:

* ``prompt(generator)`` a training prompt (a :class:`~integrations.rl.rollout.Prompt`: token ids,
  and for text tasks the text and reference answer), ``eval_prompts(n)`` held-out ones;
* ``score(prompt, completion_ids)`` the reward of a completion; ``stop_token_ids`` end a completion.

:class:`~integrations.rl.rollout.CountingTask` is the token-level toy; :class:`TextTask` is any dataset
of text (or chat) prompts with reference answers and a reward on text, tokenized by any
``transformers`` tokenizer. Built on it:

* :func:`load_gsm8k`: a user's local GSM8K-format JSONL (``question``, ``answer`` ending ``#### N``);
* :func:`arithmetic_task`: sums generated from a seed (``"12+7="`` -> ``"19"``), learnable on a CPU;
* :func:`char_tokenizer` builds a character-level tokenizer offline; :func:`load_tokenizer` loads any
  local tokenizer directory (``save_pretrained``'s).

Rewards default to :func:`~integrations.rl.rewards.math_reward`.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dataplane import InvalidArgument
from dataplane.checks import check_int
from integrations.rl.rewards import math_reward
from integrations.rl.rollout import Prompt

__all__ = [
    "Example",
    "Task",
    "TextTask",
    "arithmetic_examples",
    "arithmetic_task",
    "char_tokenizer",
    "gsm8k_answer",
    "load_gsm8k",
    "load_tokenizer",
]

GSM8K_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'


@runtime_checkable
class Task(Protocol):
    """Prompts and the reward; see the module docstring."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def prompt(self, generator: torch.Generator) -> Prompt: ...

    def eval_prompts(self, n: int) -> list[Prompt]: ...

    def score(self, prompt: Prompt, completion: Sequence[int]) -> float: ...


@dataclass(frozen=True, slots=True)
class Example:
    """One record of a text dataset.

    Attributes:
        prompt: the prompt's text, or chat messages (``[{"role": ..., "content": ...}]``, formatted with
            the tokenizer's chat template).
        answer: the reference answer the reward compares with.
    """

    prompt: str | tuple[dict[str, str], ...]
    answer: str


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("text tasks need transformers and tokenizers: pip install 'dataplane[hf]'") from e
    return transformers


def char_tokenizer(alphabet: str, *, directory: str | os.PathLike[str] | None = None) -> Any:
    """A character-level ``transformers`` tokenizer over ``alphabet`` (every character one token) with
    ``<pad>`` (0), ``<eos>`` (1) and ``<unk>`` (2), built offline with the ``tokenizers`` library;
    saved to ``directory`` when given (then :func:`load_tokenizer` loads it anywhere).

    >>> tok = char_tokenizer("0123456789+=")
    >>> tok("12+7=")["input_ids"], tok.decode([4, 5, 1], skip_special_tokens=True), len(tok)
    ([4, 5, 13, 10, 14], '12', 15)
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise InvalidArgument("char_tokenizer needs a non-empty alphabet")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = _transformers().PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    if directory is not None:
        fast.save_pretrained(os.fspath(directory))
    return fast


def load_tokenizer(directory: str | os.PathLike[str]) -> Any:
    """Any tokenizer saved with ``save_pretrained`` in a local directory (never downloaded)."""
    if not os.path.isdir(directory):
        raise InvalidArgument(f"{os.fspath(directory)!r} is not a local tokenizer directory; save_pretrained() one")
    return _transformers().AutoTokenizer.from_pretrained(os.fspath(directory), local_files_only=True)


class TextTask:
    """Prompts from a dataset of :class:`Example` records, tokenized; rewards on the decoded completion.

    Args:
        train, eval: the training records and the held-out ones (:meth:`eval_prompts` takes them in order).
        tokenizer: a ``transformers`` tokenizer with an ``eos_token`` (the stop token).
        reward: ``(completion text, reference answer) -> float``; default
            :func:`~integrations.rl.rewards.math_reward`.
        stop_token_ids: default the tokenizer's ``eos_token_id``.

    A training prompt is a record drawn uniformly (with replacement) with the caller's generator.
    """

    def __init__(
        self,
        train: Sequence[Example],
        eval: Sequence[Example],
        tokenizer: Any,
        *,
        reward: Callable[[str, str], float] = math_reward,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        if not train:
            raise InvalidArgument("a TextTask needs at least one training example")
        self.train, self.eval = list(train), list(eval)
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        stops = tuple(int(t) for t in stop_token_ids) if stop_token_ids is not None else (() if eos is None else (eos,))
        if not stops:
            raise InvalidArgument("the tokenizer has no eos_token; pass stop_token_ids")
        self._stops = stops
        self.reward = reward

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stops

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, example: Example) -> Prompt:
        """``example`` as a :class:`~integrations.rl.rollout.Prompt` (a chat through the chat template)."""
        if isinstance(example.prompt, str):
            ids = self.tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
            text = example.prompt
        else:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidArgument("chat prompts need a tokenizer with a chat_template; give text prompts instead")
            text = self.tokenizer.apply_chat_template(list(example.prompt), add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise InvalidArgument(f"prompt {example.prompt!r} tokenizes to nothing")
        return Prompt(token_ids=tuple(int(t) for t in ids), text=text, answer=example.answer)

    def prompt(self, generator: torch.Generator) -> Prompt:
        i = int(torch.randint(len(self.train), (1,), generator=generator))
        return self.encode(self.train[i])

    def eval_prompts(self, n: int) -> list[Prompt]:
        check_int("n", n, low=0)
        if n > len(self.eval):
            raise InvalidArgument(f"asked for {n} held-out prompts, the task has {len(self.eval)}")
        return [self.encode(e) for e in self.eval[:n]]

    def decode(self, completion: Sequence[int]) -> str:
        """The completion's text (up to its first stop token, special tokens dropped)."""
        ids = list(completion)
        cut = next((i for i, t in enumerate(ids) if t in self._stops), len(ids))
        return str(self.tokenizer.decode(ids[:cut], skip_special_tokens=True))

    def score(self, prompt: Prompt, completion: Sequence[int]) -> float:
        if prompt.answer is None:
            raise InvalidArgument("this prompt has no reference answer to score against")
        return float(self.reward(self.decode(completion), prompt.answer))


# -- GSM8K --------------------------------------------------------------------------------------------
def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution (the text after ``####``, commas and ``$`` dropped).

    >>> gsm8k_answer("3 * 4 = <<3*4=12>>12 apples\\n#### 1,212"), gsm8k_answer("#### -$5")
    ('1212', '-5')
    """
    if "####" not in solution:
        raise InvalidArgument(f"a GSM8K answer ends with '#### <number>', got {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")


def load_gsm8k(path: str | os.PathLike[str], *, suffix: str = GSM8K_SUFFIX, chat: bool = False) -> list[Example]:
    """Records of a local GSM8K-format JSONL file (one ``{"question": ..., "answer": ...}`` per line):
    the prompt is the question plus ``suffix`` (as one user message when ``chat``), the reference the
    number after ``####``. Blank lines are skipped; a malformed line raises
    :class:`~dataplane.InvalidArgument` naming it."""
    out: list[Example] = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                question, solution = str(rec["question"]), str(rec["answer"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InvalidArgument(
                    f"{os.fspath(path)}:{no}: expected a JSON object with 'question' and 'answer' ({e})"
                ) from None
            text = question + suffix
            prompt: str | tuple[dict[str, str], ...] = ({"role": "user", "content": text},) if chat else text
            out.append(Example(prompt=prompt, answer=gsm8k_answer(solution)))
    return out


# -- synthetic arithmetic -----------------------------------------------------------------------------
ARITHMETIC_ALPHABET = "0123456789+-="


def arithmetic_examples(n: int, *, seed: int, max_operand: int = 9, ops: str = "+") -> list[Example]:
    """``n`` problems ``"a+b="`` (operands ``0..max_operand``, an operator of ``ops``) -> the result,
    drawn from ``seed``.

    >>> [(e.prompt[-1], e.answer == str(eval(e.prompt[:-1]))) for e in arithmetic_examples(2, seed=0)]
    [('=', True), ('=', True)]
    """
    check_int("n", n, low=0)
    check_int("max_operand", max_operand, low=1)
    if not ops or set(ops) - set("+-"):
        raise InvalidArgument(f"ops must be made of '+' and '-', got {ops!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        out.append(Example(prompt=f"{a}{op}{b}=", answer=str(a + b if op == "+" else a - b)))
    return out


def arithmetic_task(
    *,
    seed: int = 0,
    max_operand: int = 9,
    ops: str = "+",
    train_size: int = 4096,
    eval_size: int = 64,
    tokenizer: Any = None,
) -> TextTask:
    """A :class:`TextTask` of :func:`arithmetic_examples`: ``train_size`` training problems from
    ``seed`` and ``eval_size`` held-out ones from another stream (the same problem space: with small
    operands the held-out problems repeat training ones, so held-out accuracy measures the policy,
    not generalisation), a :func:`char_tokenizer` over digits and operators by default, and the
    math reward (the completion's last number against the result)."""
    tok = tokenizer if tokenizer is not None else char_tokenizer(ARITHMETIC_ALPHABET)
    train = arithmetic_examples(train_size, seed=seed, max_operand=max_operand, ops=ops)
    held_out = arithmetic_examples(eval_size, seed=seed + 1_000_003, max_operand=max_operand, ops=ops)
    return TextTask(train, held_out, tok)
