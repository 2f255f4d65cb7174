"""Sampling with a KV cache gives the logprobs a full forward gives; the counting task's reward."""

from __future__ import annotations

import itertools

import pytest
import torch

from dataplane import InvalidArgument
from integrations.rl.conventions import token_logprobs
from integrations.rl.rollout import CountingTask, generate
from integrations.rl.workers.model import TinyCausalLM, TinyConfig

CFG = TinyConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, max_len=32)


def model(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(CFG)


def test_incremental_steps_equal_one_forward() -> None:
    m = model()
    ids = torch.randint(0, 16, (3, 9), generator=torch.Generator().manual_seed(1))
    full = m(ids)
    out, cache = m.step(ids[:, :4])
    parts = [out]
    for t in range(4, 9):
        out, cache = m.step(ids[:, t : t + 1], cache)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_a_full_forward_and_rows_stop_at_eos(temperature: float) -> None:
    m, task = model(), CountingTask(vocab_size=16, prompt_len=4)
    prompts = task.prompts(16, generator=torch.Generator().manual_seed(2))
    gen = generate(m, prompts, 10, eos_id=0, temperature=temperature, generator=torch.Generator().manual_seed(3))
    again = generate(m, prompts, 10, eos_id=0, temperature=temperature, generator=torch.Generator().manual_seed(3))
    assert torch.equal(gen.tokens, again.tokens) and torch.equal(gen.logprobs, again.logprobs), "same seed, same rows"
    assert gen.tokens.shape == (16, 14) and torch.equal(gen.tokens[:, :4], prompts)
    full = token_logprobs(m(gen.tokens), gen.tokens, temperature=temperature)
    mask = gen.loss_mask().bool()
    assert int(mask.sum()) == int((gen.lengths - 4).sum())
    torch.testing.assert_close(gen.logprobs[mask], full[mask], rtol=1e-5, atol=1e-5)
    for row, length in zip(gen.tokens.tolist(), gen.lengths.tolist(), strict=True):
        response = row[4:length]
        assert 0 not in response[:-1], "a row ends at its first EOS"
        assert length == 14 or response[-1] == 0
        assert all(t == 0 for t in row[length:]), "padding after the row"
    assert (gen.logprobs[~mask] == 0).all()


def test_counting_task_rewards() -> None:
    task = CountingTask(vocab_size=6, prompt_len=3, target_len=3)
    for row in task.prompts(32, generator=torch.Generator().manual_seed(0)).tolist():
        assert all(1 <= t <= 5 for t in row) and all(b == a % 5 + 1 for a, b in itertools.pairwise(row))
    assert task.reward([3, 4, 5], [1, 2, 3]) == 1.0, "counting wraps from 5 back to 1"
    assert task.reward([3, 4, 5], [1, 2, 0]) == pytest.approx(2 / 3)
    assert task.reward([3, 4, 5], [2, 3, 4]) == 0.0
    assert task.reward([3, 4, 5], [1, 2, 3, 9, 9]) == 1.0, "only the first target_len tokens count"


def test_bad_generation_arguments() -> None:
    with pytest.raises(InvalidArgument, match="prompts"):
        generate(model(), torch.zeros(2, 0, dtype=torch.int64), 4)
    with pytest.raises(InvalidArgument, match="temperature"):
        generate(model(), torch.zeros(2, 3, dtype=torch.int64), 4, temperature=-1.0)
    with pytest.raises(InvalidArgument, match="top_p"):
        generate(model(), torch.zeros(2, 3, dtype=torch.int64), 4, top_p=0.0)
    with pytest.raises(InvalidArgument, match="vocab_size"):
        CountingTask(vocab_size=2)
    with pytest.raises(InvalidArgument, match="eos_id"):
        CountingTask(eos_id=5)


def test_greedy_top_p_and_several_stop_tokens() -> None:
    """temperature 0 takes each step's argmax (log-probs of the T = 1 distribution); top-p never samples
    outside the nucleus; a row ends at the first of several stop tokens."""
    m = model()
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    greedy = generate(m, prompts, 5, temperature=0.0)
    again = generate(m, prompts, 5, temperature=0.0, generator=torch.Generator().manual_seed(9))
    assert torch.equal(greedy.tokens, again.tokens)
    with torch.no_grad():
        for row in range(2):
            ids = greedy.tokens[row : row + 1, :4]
            assert int(greedy.tokens[row, 3]) == int(m(ids[:, :3])[0, -1].argmax())
    nucleus = generate(m, prompts.repeat(20, 1), 1, top_p=0.3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        probs = torch.softmax(m(prompts)[:, -1], dim=-1)
    for row, tok in enumerate(nucleus.tokens[:, 3].tolist()):
        p = probs[row % 2]
        assert float(p[p > p[tok]].sum()) < 0.3  # the mass ranked above it is short of top_p
    stops = generate(m, prompts, 6, eos_id=(7, 9), generator=torch.Generator().manual_seed(2))
    for row, n in enumerate(stops.lengths.tolist()):
        sampled = stops.tokens[row, 3:n].tolist()
        assert all(t not in (7, 9) for t in sampled[:-1]) and (n == 9 or sampled[-1] in (7, 9))


def test_a_generator_per_block_samples_each_block_as_if_alone() -> None:
    m, task = model(), CountingTask(vocab_size=16, prompt_len=4)
    prompts = task.prompts(2, generator=torch.Generator().manual_seed(4)).repeat_interleave(3, dim=0)
    seeds = [11, 12]
    both = generate(m, prompts, 8, eos_id=0, generator=[torch.Generator().manual_seed(s) for s in seeds])
    for k, seed in enumerate(seeds):
        alone = generate(m, prompts[3 * k : 3 * k + 3], 8, eos_id=0, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(both.tokens[3 * k : 3 * k + 3], alone.tokens)
        assert torch.equal(both.lengths[3 * k : 3 * k + 3], alone.lengths)
        # the batched forward may round differently in the last bit (the samples did not move here)
        torch.testing.assert_close(both.logprobs[3 * k : 3 * k + 3], alone.logprobs, rtol=1e-6, atol=1e-6)
    with pytest.raises(InvalidArgument, match="equal block"):
        generate(m, prompts, 8, generator=[torch.Generator() for _ in range(4)])
