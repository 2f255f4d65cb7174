"""Rollout engines and text tasks in one process: the HF engine's and the torch engine's log-probs
against a full forward of the same model (written here with plain ``log_softmax``), sampling
settings, weight loading by name, the GSM8K loader and the math reward, the offline tokenizer, and
the rollout actor over any engine and task.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import dataplane
from dataplane.columns import read_columns
from integrations.rl import rewards
from integrations.rl.conventions import GEN_LOGPROBS, INPUT_IDS, LOSS_MASK, REWARD
from integrations.rl.engines import Completion, HFEngine, RolloutEngine, SamplingParams, TorchEngine
from integrations.rl.rewards import extract_answer, math_reward
from integrations.rl.rollout_actor import RolloutActor
from integrations.rl.tasks import (
    Example,
    Task,
    TextTask,
    arithmetic_examples,
    arithmetic_task,
    char_tokenizer,
    load_gsm8k,
    load_tokenizer,
)

pytest.importorskip("transformers", reason="needs transformers: pip install 'dataplane[hf]'")

from integrations.rl.workers.hf import CausalLMPolicy, load_causal_lm, tiny_config

PROMPTS = [[3, 4, 5], [7, 8], [9, 10, 11, 12]]  # unequal lengths: the HF engine left-pads


def policy(seed: int = 0, vocab: int = 24) -> CausalLMPolicy:
    return CausalLMPolicy(load_causal_lm(tiny_config("qwen2", vocab_size=vocab, initializer_range=0.1), seed=seed))


def reference_logprobs(model: CausalLMPolicy, prompt: Sequence[int], completion: torch.Tensor) -> torch.Tensor:
    """log p of each completion token under a full forward of prompt + completion (plain log_softmax)."""
    ids = torch.tensor([list(prompt) + completion.tolist()])
    with torch.no_grad():
        logits = model.lm(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
    return lp[len(prompt) - 1 :]


@pytest.mark.parametrize("engine_class", [HFEngine, TorchEngine])
def test_engine_logprobs_equal_a_full_forward_and_samples_repeat(engine_class: Any) -> None:
    model = policy()
    engine = engine_class(model)
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(n=3, max_new_tokens=6, stop_token_ids=(1,), top_p=0.9)
    out = engine.generate(PROMPTS, params, seeds=[1, 2, 3])
    again = engine.generate(PROMPTS, params, seeds=[1, 2, 3])
    assert [len(g) for g in out] == [3, 3, 3]
    worst = 0.0
    for prompt, group, group2 in zip(PROMPTS, out, again, strict=True):
        for c, c2 in zip(group, group2, strict=True):
            assert torch.equal(c.token_ids, c2.token_ids)
            assert 1 <= len(c.token_ids) <= 6 and c.logprobs.shape == c.token_ids.shape
            stops = [i for i, t in enumerate(c.token_ids.tolist()) if t == 1]
            assert stops in ([], [len(c.token_ids) - 1]) and c.finished == bool(stops)
            worst = max(worst, float((reference_logprobs(model, prompt, c.token_ids) - c.logprobs).abs().max()))
    assert worst < 1e-4
    greedy = engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=4, temperature=0), seeds=[0, 0, 0])
    for prompt, (c,) in zip(PROMPTS, greedy, strict=True):  # greedy: each token the argmax of a full forward
        ids = list(prompt)
        for tok in c.token_ids.tolist():
            with torch.no_grad():
                assert tok == int(model.lm(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)


def test_engines_load_weights_by_name_and_refuse_what_does_not_fit() -> None:
    trained, engine = policy(seed=1), HFEngine(policy(seed=0))
    specs = engine.weight_specs()
    assert set(specs) == {n for n, _ in trained.named_parameters()} and all(
        d == torch.float32 for _, d in specs.values()
    )
    engine.load_weights(dict(trained.named_parameters()), version=3)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, dict(trained.named_parameters())[name])
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    partial = dict(list(trained.named_parameters())[1:])
    with pytest.raises(dataplane.InvalidArgument, match="missing"):
        engine.load_weights(partial, version=4)
    for name, p in engine.model.named_parameters():  # unchanged
        assert torch.equal(p, before[name])
    renamed = HFEngine(policy(seed=0).lm, rename=lambda n: n.removeprefix("lm."))  # a plain HF model
    renamed.load_weights(dict(trained.named_parameters()), version=3)
    assert torch.equal(renamed.model.get_input_embeddings().weight, trained.lm.get_input_embeddings().weight)
    with pytest.raises(dataplane.InvalidArgument, match="step"):
        TorchEngine(torch.nn.Linear(2, 2))


def test_sampling_params_are_checked() -> None:
    for bad in ({"n": 0}, {"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(dataplane.InvalidArgument):
            SamplingParams(**bad)
    with pytest.raises(dataplane.InvalidArgument, match="seed"):
        TorchEngine(policy()).generate(PROMPTS, SamplingParams(), seeds=[1])


# -- tasks and rewards --------------------------------------------------------------------------------
def test_gsm8k_loader_and_math_reward(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    records = [
        {"question": "Tom has 3 bags of 4 apples. How many?", "answer": "3 * 4 = <<3*4=12>>12\n#### 12"},
        {"question": "A car costs $1,250 more than $2,000.", "answer": "2000 + 1250 = <<2000+1250=3250>>\n#### 3,250"},
        {"question": "It fell from 5 to -3. Change?", "answer": "-3 - 5 = -8\n#### -8"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    examples = load_gsm8k(path)
    assert [e.answer for e in examples] == ["12", "3250", "-8"]
    assert (
        isinstance(examples[0].prompt, str)
        and examples[0].prompt.startswith("Tom has")
        and "####" in examples[0].prompt
    )
    chat = load_gsm8k(path, chat=True)
    assert chat[0].prompt[0]["role"] == "user"  # type: ignore[index]
    for use in (True, False):  # with math-verify where installed, and the built-in normaliser
        score = lambda text, ans, use=use: math_reward(text, ans, use_math_verify=use)  # noqa: E731
        assert score("3 bags of 4 is 12 apples.\n#### 12", "12") == 1.0
        assert score("so the answer is \\boxed{3250}", "3250") == 1.0
        assert score("#### 3,250", "3250") == 1.0 and score("#### $3,250.00", "3250") == 1.0
        assert score("the change is -8", "-8") == 1.0 and score("#### 8", "-8") == 0.0
        assert score("#### 13", "12") == 0.0  # wrong
        assert score("I do not know", "12") == 0.0 and score("", "12") == 0.0  # malformed
        assert score("#### ", "12") == 0.0
    assert extract_answer("first 3, then #### 7 and 9") == "7 and 9" and math_reward("#### 7 and 9", "7") == 0.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(dataplane.InvalidArgument, match=r"bad\.jsonl:1"):
        load_gsm8k(bad)
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(dataplane.InvalidArgument, match="####"):
        load_gsm8k(bad)


def test_math_verify_path_when_installed() -> None:
    if rewards._math_verify() is None:
        pytest.skip("math-verify is not installed (pip install math-verify): the built-in normaliser is used")
    assert math_reward("\\boxed{\\frac{144}{2}}", "72") == 1.0
    assert math_reward("\\boxed{\\frac{144}{3}}", "72") == 0.0
    assert math_reward("\\boxed{\\frac{144}{2}}", "72", use_math_verify=False) == 0.0  # not a plain number


def test_char_tokenizer_round_trips_through_a_directory_and_text_task_scores(tmp_path: Path) -> None:
    char_tokenizer("0123456789+-=", directory=tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12+7=" and tok.eos_token_id == 1 and tok.pad_token_id == 0
    with pytest.raises(dataplane.InvalidArgument, match="local tokenizer"):
        load_tokenizer(tmp_path / "nowhere")
    task = TextTask([Example("12+7=", "19")], [Example("1+1=", "2")], tok)
    assert isinstance(task, Task) and task.stop_token_ids == (1,)
    prompt = task.prompt(torch.Generator().manual_seed(0))
    assert list(prompt.token_ids) == ids and prompt.answer == "19"
    nineteen = tok("19", add_special_tokens=False)["input_ids"]
    assert task.score(prompt, [*nineteen, 1, *tok("5", add_special_tokens=False)["input_ids"]]) == 1.0  # cut at EOS
    assert task.score(prompt, tok("18", add_special_tokens=False)["input_ids"]) == 0.0
    assert [p.answer for p in task.eval_prompts(1)] == ["2"]
    with pytest.raises(dataplane.InvalidArgument, match="chat_template"):
        TextTask([Example(({"role": "user", "content": "hi"},), "1")], [], tok).prompt(torch.Generator())
    examples = arithmetic_examples(50, seed=3, max_operand=12, ops="+-")
    assert all(e.answer == str(eval(e.prompt[:-1])) for e in examples)
    assert arithmetic_examples(5, seed=3) == arithmetic_examples(5, seed=3) != arithmetic_examples(5, seed=4)


# -- the rollout actor over any engine and task -------------------------------------------------------
class EchoEngine:
    """An engine of its own (not a torch module): answers every prompt with a fixed completion."""

    def __init__(self, answer: list[int]) -> None:
        self.answer, self.loaded = answer, -1

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Completion]]:
        ids = torch.tensor(self.answer[: params.max_new_tokens])
        done = Completion(token_ids=ids, logprobs=torch.full(ids.shape, -0.5), finished=True)
        return [[done] * params.n for _ in prompts]

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.loaded = version

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {}


def test_rollout_actor_takes_any_engine_and_text_task() -> None:
    task = arithmetic_task(seed=0, max_operand=4, train_size=32, eval_size=4)
    tok = task.tokenizer
    actor = RolloutActor(
        EchoEngine([*tok("7", add_special_tokens=False)["input_ids"], 1]),
        task,
        prompts_per_step=3,
        group_size=2,
        max_new_tokens=3,
    )
    actor.load_weights({}, version=5)
    assert actor.engine.loaded == 5  # type: ignore[attr-defined]
    with dataplane.connect() as client:
        actor._client = client  # in-process: the memory store is fine here
        out = actor.rollout(0, "p")
        rows = read_columns(client, out.meta, [INPUT_IDS, LOSS_MASK, GEN_LOGPROBS, REWARD])
    for i, n in enumerate(out.meta.sequence_lengths or ()):
        text = tok.decode(rows[INPUT_IDS][i][:n].tolist(), skip_special_tokens=True)
        assert text.endswith("=7") and rows[LOSS_MASK][i].sum() == 2  # "7" and EOS
        expected = 1.0 if eval(text.split("=")[0]) == 7 else 0.0
        assert rows[REWARD][i].item() == expected == out.rewards[i].item()
        assert torch.equal(rows[GEN_LOGPROBS][i][rows[LOSS_MASK][i].bool()], torch.full((2,), -0.5))
    ev = actor.evaluate(4)
    assert ev["eval_prompts"] == 4 and 0 <= ev["eval_accuracy"] <= ev["eval_reward"] <= 1
    with pytest.raises(dataplane.InvalidArgument, match="RolloutEngine"):
        RolloutActor(42, task)


def test_the_examples_build_a_gsm8k_task_from_a_users_file(tmp_path: Path) -> None:
    """``--task FILE``: the last ``--eval-prompts`` records are held out, a character tokenizer is built
    from the file when no ``--tokenizer`` is given, and the models' vocabulary is its size."""
    from integrations.rl.examples import grpo_text, models

    path = tmp_path / "train.jsonl"
    lines = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    opts = replace(grpo_text.DEFAULTS, task_name=str(path), eval_prompts=4)
    task = models.build_task(opts)
    assert (
        isinstance(task, TextTask)
        and len(task.train) == 8
        and [p.answer for p in task.eval_prompts(4)] == ["16", "18", "20", "22"]
    )
    assert models.model_vocab(opts, task) == len(task.tokenizer) and task.tokenizer.decode(
        task.prompt(torch.Generator()).token_ids
    ).startswith("What is")
    with pytest.raises(dataplane.InvalidArgument, match="more than --eval-prompts"):
        models.build_task(replace(opts, eval_prompts=12))
    with pytest.raises(dataplane.InvalidArgument, match="GSM8K-format JSONL"):
        replace(opts, task_name=str(tmp_path / "missing.jsonl"))
    with pytest.raises(dataplane.InvalidArgument, match="--engine hf"):
        models.rollout_model(replace(grpo_text.DEFAULTS, model="tiny"))
