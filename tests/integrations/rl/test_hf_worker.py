"""Hugging Face causal LMs on the FSDP2 worker: tiny random-init Qwen2 and Llama configs, 2 DP gloo
ranks, rows through a real ``mooncake://local``, checked against single-process transformers forwards
and steps written here apart from the code under test.

One process group runs every scenario (``run_ranks``); the single-process checks (chunked against
whole logits, the memory rule, ``from_pretrained``) need no ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rl_checks import write_rollout

import dataplane
from dataplane import KVBatchMeta
from dataplane.columns import read_columns
from dataplane.testing.ranks import run_ranks
from integrations.rl.conventions import token_logprobs
from integrations.rl.losses import ClippedPolicyLoss
from integrations.rl.split_step import clip_grad_norm_

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'dataplane[hf]'")

from integrations.rl.workers.hf import (  # noqa: E402 - after the skip
    CausalLMPolicy,
    CausalLMValue,
    HFCausalLMWorker,
    load_causal_lm,
    tiny_config,
)

VOCAB, WIDTH, GROUP, LR = 64, 20, 2, 0.5
UIDS = [f"p{i}" for i in range(5)]
FAMILIES = ("qwen2", "llama")


def config(family: str) -> Any:
    return tiny_config(family, vocab_size=VOCAB, max_positions=64)


def rollout() -> tuple[dict[str, torch.Tensor], list[int]]:
    g = torch.Generator().manual_seed(11)
    n = len(UIDS) * GROUP
    lengths = torch.randint(4, WIDTH + 1, (n,), generator=g).tolist()
    ids = torch.randint(1, VOCAB, (n, WIDTH), generator=g)
    mask = torch.zeros(n, WIDTH, dtype=torch.int64)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
        mask[i, 3:length] = 1  # three prompt tokens
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(n, generator=g)}, lengths


def _rank(rank: int, world: int, url: str, shards: list[KVBatchMeta]) -> dict[str, Any]:
    from integrations.rl.workers.dtensor import full_parameters

    shard = shards[rank]
    out: dict[str, Any] = {}
    with dataplane.connect(url) as client:
        for family in FAMILIES:
            cfg = config(family)
            policy = HFCausalLMWorker(cfg, precision="fp32", optimizer="sgd", lr=LR, seed=0)
            value = HFCausalLMWorker(cfg, role="value", precision="fp32", seed=0)
            bf16 = HFCausalLMWorker(cfg, precision="bf16", seed=0)
            for w in (policy, value, bf16):
                w.setup_data_plane(client)
            policy.get_logprobs_presharded(shard, out_field=f"{family}/lp")  # kept for the check
            policy.get_logprobs_presharded(shard)  # prev_logprobs, which the loss reads
            out[f"{family}/forward_metrics"] = policy.forward_metrics
            value.get_values_presharded(shard, out_field=f"{family}/values")
            bf16.get_logprobs_presharded(shard, out_field=f"{family}/lp_bf16")
            out[f"{family}/train"] = policy.train_presharded(shard, ClippedPolicyLoss())
            out[f"{family}/params"] = full_parameters(policy.model)  # a collective: every rank gathers
            out[f"{family}/bf16_train"] = bf16.train_presharded(shard, ClippedPolicyLoss())
            if family == "qwen2":  # activation checkpointing: the same step, recomputed per layer
                ac = HFCausalLMWorker(
                    cfg, precision="fp32", optimizer="sgd", lr=LR, seed=0, activation_checkpointing=True
                )
                ac.setup_data_plane(client)
                ac.train_presharded(shard, ClippedPolicyLoss())
                out["ac_params"] = full_parameters(ac.model)
                # a warm-up schedule: the first step trains at a third of the peak rate, the next at two thirds
                warm = HFCausalLMWorker(cfg, precision="fp32", lr=0.3, warmup_steps=2, seed=0)
                warm.setup_data_plane(client)
                out["warmup_lr"] = [warm.train_presharded(shard, ClippedPolicyLoss())["lr"] for _ in range(3)]
            for w in (policy, value, bf16):
                w.close_data_plane()
    return out


def reference_step(lm: torch.nn.Module, fields: dict[str, torch.Tensor], lengths: list[int], prev: Any) -> None:
    """One single-process step of the whole batch: every row's loss summed, divided by the valid
    tokens, clipped at 1, one SGD step of ``LR``; from whole logits, one row at a time."""
    loss_fn, losses = ClippedPolicyLoss(), []
    valid = sum(int(fields["loss_mask"][i].sum()) for i in range(len(lengths)))
    lm.zero_grad()
    for i, length in enumerate(lengths):
        ids = fields["input_ids"][i : i + 1, :length]
        lp = token_logprobs(lm(input_ids=ids).logits, ids)
        row = {
            "loss_mask": fields["loss_mask"][i : i + 1, :length],
            "prev_logprobs": prev[i][None],
            "advantages": fields["advantages"][i : i + 1],
        }
        losses.append(loss_fn(lp, row).loss)
    (torch.stack(losses).sum() / valid).backward()
    clip_grad_norm_(list(lm.parameters()), 1.0)
    with torch.no_grad():
        for p in lm.parameters():
            p -= LR * p.grad


@pytest.mark.multiprocess
@pytest.mark.mooncake
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_models_on_two_dp_ranks_equal_single_process_transformers() -> None:
    pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")
    fields, lengths = rollout()
    with dataplane.connect("mooncake://local") as owner:
        meta, shards = write_rollout(owner, fields, lengths, uids=UIDS, group=GROUP, partition="hf", mb_tokens=40)
        results = run_ranks(_rank, 2, owner.url, shards, timeout_s=360)
        names = [f"{f}/{x}" for f in FAMILIES for x in ("lp", "values", "lp_bf16")]
        got = read_columns(owner, meta, ["input_ids", *names], layout="jagged")

    total = sum(lengths)
    for family in FAMILIES:
        lm = load_causal_lm(config(family), seed=0)
        critic = CausalLMValue(load_causal_lm(config(family), seed=0, base_only=True), seed=1)
        prev = []
        worst_bf16 = 0.0
        with torch.no_grad():
            for i, length in enumerate(lengths):
                ids = got["input_ids"][i][None]
                lp, v, lp16 = (got[f"{family}/{x}"][i] for x in ("lp", "values", "lp_bf16"))
                assert lp.shape == v.shape == lp16.shape == (length,), "token-aligned: one entry per token"
                assert lp[0] == 0 and v[0] == 0 and lp16[0] == 0, "position 0 holds 0"
                expect = token_logprobs(lm(input_ids=ids).logits, ids)[0]
                torch.testing.assert_close(lp, expect, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(v, torch.cat([torch.zeros(1), critic(ids)[0, :-1]]), rtol=1e-6, atol=1e-6)
                worst_bf16 = max(worst_bf16, float((lp16 - expect).abs().max()))
                prev.append(expect)
        # bf16 parameters and compute (fp32 log-softmax): close to fp32 at bf16's precision, not equal
        assert 0 < worst_bf16 < 0.1, worst_bf16

        reference_step(lm, fields, lengths, prev)
        trained = results[0][f"{family}/params"]
        assert trained.keys() == {f"lm.{k}" for k, _ in lm.named_parameters()}
        moved = 0.0
        before = dict(load_causal_lm(config(family), seed=0).named_parameters())
        for name, p in lm.named_parameters():
            moved = max(moved, float((p.detach() - before[name].detach()).abs().max()))
            torch.testing.assert_close(trained[f"lm.{name}"], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert moved > 1e-3, "the step moved the weights"
        for r in results:
            t = r[f"{family}/train"]
            assert t["num_elements"] == sum(int(fields["loss_mask"][i].sum()) for i in range(len(lengths)))
            assert abs(t["ratio_min"] - 1) < 1e-5 and abs(t["ratio_max"] - 1) < 1e-5  # prev came from these weights
            assert t["lr"] == LR and 0 < t["entropy"] < float(torch.log(torch.tensor(float(VOCAB)))) + 1e-4
            assert t["num_tokens_real"] == total and t["num_tokens_computed"] >= total
            assert t["real_token_share"] == total / t["num_tokens_computed"] <= 1
            assert r[f"{family}/forward_metrics"]["num_tokens_real"] == total
            assert r[f"{family}/bf16_train"]["num_elements"] == t["num_elements"]
    for name, p in results[0]["qwen2/params"].items():  # activation checkpointing changes no number
        torch.testing.assert_close(results[0]["ac_params"][name], p, rtol=1e-6, atol=1e-7, msg=name)
    assert results[0]["warmup_lr"] == pytest.approx([0.1, 0.2, 0.3])


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_logprobs_and_gradients_equal_whole_logits(family: str) -> None:
    """The policy's chunked path against transformers' own logits, values and gradients, in fp32."""
    ids = rollout()[0]["input_ids"]
    policy = CausalLMPolicy(load_causal_lm(config(family), seed=0), chunk_tokens=7)
    lp, ent = policy(ids, temperature=0.8, entropy=True)
    lp.sum().backward()
    chunked = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    whole = token_logprobs(policy(ids, output="logits"), ids, temperature=0.8)
    whole.sum().backward()
    torch.testing.assert_close(lp, whole, rtol=1e-6, atol=1e-6)
    for n, p in policy.named_parameters():  # summed in another order: equal relative to each gradient's scale
        scale = float(p.grad.abs().max())
        assert scale > 0 and float((chunked[n] - p.grad).abs().max()) <= 1e-5 * scale, n
    assert ent.shape == lp.shape and not ent.requires_grad and bool((ent[:, 1:] > 0).all())


def test_no_saved_tensor_holds_more_than_one_chunk_of_logits() -> None:
    """The memory rule on a real HF model: the backward keeps no ``[*, V]`` tensor over one chunk
    (transformers' own logits keep all of them: the rule can fail)."""
    vocab, chunk = 4096, 16
    policy = CausalLMPolicy(load_causal_lm(tiny_config("llama", vocab_size=vocab), seed=0), chunk_tokens=chunk)
    ids = torch.randint(0, vocab, (4, 33))

    def widest_saved(fn: Any) -> int:
        sizes = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 1 and t.shape[-1] == vocab and t.data_ptr() != policy.lm.lm_head.weight.data_ptr():
                sizes.append(t.numel() // vocab)  # token positions of [*, V] it holds
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn().sum().backward()
        return max(sizes)

    assert widest_saved(lambda: policy(ids)) <= chunk
    assert widest_saved(lambda: token_logprobs(policy(ids, output="logits"), ids)) >= 4 * 32


def test_from_pretrained_of_a_saved_directory_gives_the_same_logprobs(tmp_path: Path) -> None:
    lm = load_causal_lm(config("qwen2"), seed=5)
    lm.save_pretrained(tmp_path / "model")
    loaded = load_causal_lm(tmp_path / "model")
    ids = rollout()[0]["input_ids"][:3]
    with torch.no_grad():
        a, b = CausalLMPolicy(lm)(ids), CausalLMPolicy(loaded)(ids)
    assert torch.equal(a, b)
    with pytest.raises(dataplane.InvalidArgument, match="not a local directory"):
        load_causal_lm(tmp_path / "missing")
    with pytest.raises(dataplane.InvalidArgument, match="output must be"):
        CausalLMPolicy(lm)(ids, output="probs")
