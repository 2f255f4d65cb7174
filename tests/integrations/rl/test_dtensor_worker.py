"""The DTensor worker mixin through a real store: 2 DP x 2 TP gloo ranks on ``mooncake://local``.

The test process owns the store and writes rollout rows; four ranks (tiny policy and critic, TP
over pairs of ranks, FSDP over DP) join it by URL with the shard metas the preshard step made, and
write logprobs and values back from each replica group's leader. The test then reads every row and
checks it against a single-process forward of the same weights.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from rl_checks import write_rollout

import dataplane
from dataplane import KVBatchMeta
from dataplane.columns import read_columns
from dataplane.observability import CallEvent, ObservedClient
from dataplane.preshard import shard_meta_for_dp
from dataplane.testing.ranks import run_ranks
from integrations.rl.conventions import token_logprobs
from integrations.rl.losses import ClippedPolicyLoss
from integrations.rl.split_step import clip_grad_norm_
from integrations.rl.workers.model import TinyCausalLM, TinyConfig
from integrations.rl.workers.tiny import TinyDTensorWorker

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

POLICY = TinyConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, max_len=32)
CRITIC = TinyConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, max_len=32, head="value")
UIDS, GROUP, TP = [f"p{i}" for i in range(6)], 2, 2
READ_LIMIT_S = 20.0
LR = 0.5


def rollout() -> tuple[dict[str, Any], list[int]]:
    g = torch.Generator().manual_seed(7)
    n = len(UIDS) * GROUP
    lengths = torch.randint(3, 25, (n,), generator=g).tolist()
    ids = torch.randint(1, POLICY.vocab_size, (n, 24), generator=g)
    mask = torch.zeros(n, 24, dtype=torch.int64)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
        mask[i, 2:length] = 1  # two prompt tokens, the rest generated
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(n, generator=g)}, lengths


def _rank(
    rank: int,
    world: int,
    url: str,
    shards: list[KVBatchMeta],
    unplanned: list[KVBatchMeta],
    one_row: list[KVBatchMeta],
    bad: KVBatchMeta,
) -> dict[str, Any]:
    events: list[CallEvent] = []
    client = ObservedClient(dataplane.connect(url), events.append)
    out: dict[str, Any] = {}
    try:
        policy = TinyDTensorWorker(POLICY, tp=TP, seed=0, optimizer="sgd", lr=LR)
        critic = TinyDTensorWorker(CRITIC, tp=TP, seed=1)
        for w in (policy, critic):
            w.setup_data_plane(client)
        dp = policy.device_mesh.get_local_rank("dp")
        shard = shards[dp]
        out["leader"] = policy.is_writeback_leader()
        written = policy.get_logprobs_presharded(shard)
        out["logprob_fields"] = None if written is None else list(written.fields)
        # no plan in these metas: 2 rows per forward gives DP rank 0 four forwards and rank 1 three,
        # so rank 1 runs an empty one to stay in step with its peer's FSDP gathers
        critic.forward_micro_batch_size = 2
        critic.get_values_presharded(unplanned[dp])
        # one row for two DP ranks: rank 1's shard is empty and it runs a dummy forward beside rank 0
        critic.get_values_presharded(one_row[dp], out_field="values_one")
        metrics = policy.train_presharded(shard, ClippedPolicyLoss())
        out["train"] = {k: metrics[k] for k in ("num_elements", "ratio_min", "ratio_max", "clip_fraction")}
        out["version"] = policy.weight_version
        trained = policy.state()["params"]  # a collective: every rank gathers
        out["params"] = trained if rank == 0 else None
        out["puts"] = [(e.op, e.n_keys) for e in events if e.op == "kv_batch_put"]
        t0 = time.monotonic()
        try:
            policy.get_logprobs_presharded(bad if dp == 0 else shard)
            out["bad"] = None
        except Exception as e:
            out["bad"] = (type(e).__name__, str(e))
        out["bad_s"] = time.monotonic() - t0
        # every rank is still in step after the failure: a clean call works
        out["after_bad"] = (policy.get_logprobs_presharded(shard, out_field="again") is not None) == out["leader"]
    finally:
        client.close()
    return out


@pytest.mark.timeout(300)
def test_logprobs_and_values_presharded_write_each_key_once_token_aligned() -> None:
    fields, lengths = rollout()
    with dataplane.connect("mooncake://local") as owner:
        meta, shards = write_rollout(owner, fields, lengths, uids=UIDS, group=GROUP, partition="rl", mb_tokens=48)
        bad = KVBatchMeta(
            partition_id="rl",
            keys=[*shards[0].keys, "no-such-row"],
            sequence_lengths=[*shards[0].sequence_lengths, 4],
        )
        unplanned = [meta.subset(range(7)), meta.subset(range(7, meta.size))]
        one_row = shard_meta_for_dp(meta.subset([3]), 2)
        assert [s.size for s in one_row] == [1, 0]
        results = run_ranks(_rank, 4, owner.url, shards, unplanned, one_row, bad, timeout_s=240)

        n = meta.size
        puts = [p for r in results for p in r["puts"]]
        assert sum(k for _, k in puts) == 2 * n + 1, "logprobs, values, one row: every key once; train writes nothing"
        for rank, r in enumerate(results):
            assert r["leader"] == (rank % TP == 0)
            assert (r["logprob_fields"] is not None) == r["leader"]
            assert (len(r["puts"]) > 0) == r["leader"], "only leaders write"
        got = read_columns(owner, meta, ["input_ids", "prev_logprobs", "values", "again"], layout="jagged")
        one = read_columns(owner, one_row[0], ["values_one"], layout="jagged")["values_one"][0]
        torch.testing.assert_close(one, got["values"][3], rtol=1e-5, atol=1e-6)  # alone vs in a batch
        # written after the step, so from other weights: same rows, other values
        assert torch.equal(got["again"].offsets(), got["prev_logprobs"].offsets())
        assert not torch.equal(got["again"].values(), got["prev_logprobs"].values())

    torch.manual_seed(0)
    policy = TinyCausalLM(POLICY)
    torch.manual_seed(1)
    critic = TinyCausalLM(CRITIC)
    valid = 0
    with torch.no_grad():
        for i, length in enumerate(lengths):
            ids = got["input_ids"][i]
            lp, v = got["prev_logprobs"][i], got["values"][i]
            assert lp.shape == v.shape == (length,), "token-aligned: one value per token of the row"
            assert lp[0] == 0 and v[0] == 0, "position 0 holds 0"
            expect_lp = token_logprobs(policy(ids[None]), ids[None])[0]
            expect_v = torch.cat([torch.zeros(1), critic(ids[None])[0, :-1]])
            torch.testing.assert_close(lp, expect_lp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, expect_v, rtol=1e-5, atol=1e-5)
            valid += length - 2

    # The step through the store on 2 DP x 2 TP ranks equals one single-process step on the same rows:
    # every row's loss summed, divided by the global count, clipped, one SGD step.
    policy.zero_grad()
    loss_fn, losses = ClippedPolicyLoss(), []
    for i, length in enumerate(lengths):
        ids = got["input_ids"][i][None]
        lp = token_logprobs(policy(ids), ids)
        row = {
            "loss_mask": fields["loss_mask"][i : i + 1, :length],
            "prev_logprobs": lp.detach(),
            "advantages": fields["advantages"][i : i + 1],
        }
        losses.append(loss_fn(lp, row).loss)
    (torch.stack(losses).sum() / valid).backward()
    clip_grad_norm_(list(policy.parameters()), 1.0)
    with torch.no_grad():
        for p in policy.parameters():
            p -= LR * p.grad
    trained = results[0]["params"]
    torch.manual_seed(0)
    before = {k: v.detach() for k, v in TinyCausalLM(POLICY).named_parameters()}
    assert max(float((trained[k] - before[k]).abs().max()) for k in before) > 1e-3, "the step moved the weights"
    for name, p in policy.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)

    for r in results:
        t = r["train"]
        assert t["num_elements"] == valid and r["version"] == 1
        # prev_logprobs came from the same weights: every ratio is 1, nothing is clipped
        assert abs(t["ratio_min"] - 1) < 1e-5 and abs(t["ratio_max"] - 1) < 1e-5 and t["clip_fraction"] == 0
        name, message = r["bad"]
        assert name == "KeyNotFound" and "no-such-row" in message, r["bad"]
        assert r["bad_s"] < READ_LIMIT_S and r["after_bad"]
    assert len({r["bad"] for r in results}) == 1, "every rank raises the same error"
