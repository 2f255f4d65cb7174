"""The Megatron worker on GPUs over NCCL: its split step against Megatron's own one-shot step, its
hooks under failure and abort, and its presharded forwards through a real store.

Needs CUDA GPUs and megatron-core (Python >= 3.12: ``pip install 'dataplane[megatron]'``); CI has
neither and skips this module. Run it on a GPU machine:
``python -m pytest tests/integrations/rl/test_megatron_gpu.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs (NCCL process groups)"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="needs megatron-core (pip install 'dataplane[megatron]'; Python >= 3.12 and CUDA)",
    ),
]

HOOKS = ("grad_sync_func", "no_sync_func", "finalize_model_grads_func")
B, T, LR = 2, 16, 0.05
# (world, tp, pp, overlap_grad_reduce, calculate_per_token_loss): DP = world / (tp * pp)
LAYOUTS = {
    "one_gpu": (1, 1, 1, True, True),
    "dp2": (2, 1, 1, True, True),
    "dp2_mean_ddp": (2, 1, 1, False, False),
    "tp2": (2, 2, 1, False, True),
    "pp2": (2, 1, 2, True, True),
    "dp2xtp2": (4, 2, 1, True, True),
    "dp2xpp2": (4, 1, 2, False, True),
}


def _shape(head: str = "lm") -> Any:
    from integrations.rl.workers.model import TinyConfig

    return TinyConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_len=64, head=head)  # type: ignore[arg-type]


def _microbatches(dp_rank: int, step: int, count: int) -> list[Any]:
    """``count`` microbatches of ``B`` rows (``T`` wide, ragged valid lengths) for one DP rank."""
    from tensordict import TensorDict

    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + i)
        ids = torch.randint(1, 64, (B, T), generator=g)
        mask = torch.zeros(B, T, dtype=torch.int64)
        for r in range(B):
            length = int(torch.randint(4, T + 1, (1,), generator=g))
            ids[r, length:] = 0
            mask[r, 2:length] = 1
        prev = -3.0 + 0.5 * torch.randn(B, T, generator=g)
        adv = torch.randn(B, generator=g)
        td = TensorDict({"input_ids": ids, "loss_mask": mask, "prev_logprobs": prev, "advantages": adv}, batch_size=[B])
        out.append(td.to(torch.device("cuda", torch.cuda.current_device())))
    return out


def _one_shot(worker: Any, mbs: list[Any], loss_fn: Any) -> tuple[float, float]:
    """Megatron's own training step: every microbatch through its schedule (its hooks reduce once,
    ``calculate_per_token_loss`` divides by the global count), then its optimizer. Returns the summed
    local loss (last stage; 0 elsewhere) and the optimizer's grad norm."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, opt = worker.model, worker.optimizer
    model.zero_grad_buffer()
    opt.zero_grad()
    model.train()

    def forward_step(it: Any, m: Any) -> Any:
        mb = next(it)
        out = worker.megatron_forward(m, mb["input_ids"])

        def loss_func(o: torch.Tensor) -> Any:
            r = loss_fn(worker.logprobs_from_output(o, mb["input_ids"]), mb)
            return r.loss, r.count.to(torch.int), {"sum": r.loss.detach()}

        return out, loss_func

    stored = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=T,
        micro_batch_size=B,
        forward_only=False,
    )
    _, norm, _ = opt.step()
    return float(sum(float(s["sum"]) for s in stored)), float(norm)


def _local_params(worker: Any) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in worker.model.parameters()]


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / (y.abs().max() + 1e-12)) for x, y in zip(a, b, strict=True))


def _parity(rank: int, world: int, tp: int, pp: int, overlap: bool, per_token: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from integrations.rl.losses import ClippedPolicyLoss
    from integrations.rl.workers.megatron_tiny import TinyMegatronWorker

    split = TinyMegatronWorker(
        _shape(), tp=tp, pp=pp, lr=LR, overlap_grad_reduce=overlap, calculate_per_token_loss=per_token
    )
    ref = TinyMegatronWorker(_shape(), tp=tp, pp=pp, lr=LR, overlap_grad_reduce=overlap, calculate_per_token_loss=True)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    last = ps.is_pipeline_last_stage()
    cfg = split.megatron_config()
    before_hooks = {h: getattr(cfg, h) for h in HOOKS}
    loss_fn = ClippedPolicyLoss()
    start = _local_params(split)
    out: dict[str, Any] = {"steps": []}
    for step in range(2):  # the second step is where a leaked no_sync_func / undispatched sync asserts
        # DP rank 1 has one microbatch fewer: the split step pads it with a dummy, Megatron's schedule
        # simply runs fewer
        mbs = _microbatches(dp_rank, step, 3 if dp_rank == 0 or dp == 1 else 2)
        ref_sum, ref_norm = _one_shot(ref, mbs, loss_fn)
        n_local = sum(float(loss_fn(torch.zeros(B, T, device=m.device), m).count) for m in mbs)
        totals = torch.tensor([ref_sum, n_local], dtype=torch.float64, device="cuda")
        if dp > 1:
            dist.all_reduce(totals, group=ps.get_data_parallel_group())
        split.begin_train_step(loss_fn)
        nulled = cfg.finalize_model_grads_func is None and cfg.grad_sync_func is None
        for mb in mbs:
            split.train_microbatch(mb)
        for _ in range(3 - len(mbs)):
            split.train_microbatch(split.dummy_microbatch(mbs[0]), dummy=True)
        metrics = split.finish_train_step()
        out["steps"].append(
            {
                "nulled_during_step": nulled,
                "hooks_restored": all(getattr(cfg, h) is before_hooks[h] for h in HOOKS),
                "n": metrics["num_elements"],
                "n_expected": float(totals[1]) if last else None,
                "loss": metrics["loss"],
                "loss_ref": float(totals[0] / totals[1]) if last else None,
                "grad_norm": metrics["grad_norm"],
                "grad_norm_ref": ref_norm,
                "params_max_rel": _max_rel(_local_params(split), _local_params(ref)),
                "moved_from_start": _max_rel(_local_params(split), start),
                "version": split.weight_version,
            }
        )
    out["rank"], out["world"] = rank, world
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_split_step_equals_megatrons_one_shot_step(layout: str) -> None:
    from dataplane.testing.ranks import run_ranks

    world, tp, pp, overlap, per_token = LAYOUTS[layout]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    results = run_ranks(_parity, world, tp, pp, overlap, per_token, backend="nccl", timeout_s=420, pg_timeout_s=120)
    for r in results:
        for i, s in enumerate(r["steps"]):
            where = (layout, r["rank"], i, s)
            assert s["nulled_during_step"] and s["hooks_restored"] and s["version"] == i + 1, where
            if s["n_expected"] is not None:
                assert s["n"] == s["n_expected"] and s["n"] > 0, where
                assert s["loss"] == pytest.approx(s["loss_ref"], rel=1e-5, abs=1e-6), where
            assert s["grad_norm"] == pytest.approx(s["grad_norm_ref"], rel=1e-5), where
            assert s["params_max_rel"] < 1e-5 and s["moved_from_start"] > 1e-4, where
    # the step's metrics are the same on every rank (broadcast from the last pipeline stage)
    assert len({tuple(round(s["loss"], 9) for s in r["steps"]) for r in results}) == 1


def _failures(rank: int, world: int, tp: int, pp: int) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from integrations.rl.losses import ClippedPolicyLoss
    from integrations.rl.split_step import PeerFailure, TrainStepError
    from integrations.rl.workers.megatron_tiny import TinyMegatronWorker

    class FailingLoss(ClippedPolicyLoss):
        calls = 0

        def __call__(self, outputs: torch.Tensor, batch: Any) -> Any:
            FailingLoss.calls += 1
            if dist.get_rank() == world - 1 and FailingLoss.calls == 2:
                raise ValueError("planted failure in the loss")
            return super().__call__(outputs, batch)

    worker = TinyMegatronWorker(_shape(), tp=tp, pp=pp, lr=LR, overlap_grad_reduce=True)
    fresh = TinyMegatronWorker(_shape(), tp=tp, pp=pp, lr=LR, overlap_grad_reduce=True)
    cfg = worker.megatron_config()
    hooks = {h: getattr(cfg, h) for h in HOOKS}
    start = _local_params(worker)
    mbs = _microbatches(ps.get_data_parallel_rank(), 0, 3)
    out: dict[str, Any] = {"rank": rank}

    def clean() -> bool:
        grads_zero = all(float(b.grad_data.abs().max()) == 0.0 for b in worker.model.buffers)
        return (
            all(getattr(cfg, h) is hooks[h] for h in HOOKS)
            and not worker.train_step_open
            and grads_zero
            and _max_rel(_local_params(worker), start) == 0.0
            and worker.weight_version == 0
        )

    # an exception inside a microbatch: every rank raises, the step is dropped, every hook restored
    worker.begin_train_step(FailingLoss())
    try:
        for mb in mbs:
            worker.train_microbatch(mb)
        out["raised"] = None
    except (ValueError, PeerFailure) as e:
        out["raised"] = type(e).__name__
    out["clean_after_failure"] = clean()
    # a second begin while open is refused and leaves the open step as it was
    worker.begin_train_step(ClippedPolicyLoss())
    worker.train_microbatch(mbs[0])
    try:
        worker.begin_train_step(ClippedPolicyLoss())
        out["double_begin"] = None
    except TrainStepError:
        out["double_begin"] = "TrainStepError"
    out["still_open_and_nulled"] = worker.train_step_open and cfg.finalize_model_grads_func is None
    # abort: the model as before begin
    worker.abort_train_step()
    worker.abort_train_step()  # idempotent
    out["clean_after_abort"] = clean()
    # then two whole steps equal a fresh model's two steps
    for step in range(2):
        for w in (worker, fresh):
            w.begin_train_step(ClippedPolicyLoss())
            for mb in _microbatches(ps.get_data_parallel_rank(), step + 1, 2):
                w.train_microbatch(mb)
            w.finish_train_step()
    out["after_abort_equals_fresh"] = _max_rel(_local_params(worker), _local_params(fresh))
    out["version"] = worker.weight_version
    return out


@pytest.mark.parametrize("layout", ["one_gpu", "dp2", "pp2"])
def test_megatron_failure_and_abort_restore_every_hook(layout: str) -> None:
    from dataplane.testing.ranks import run_ranks

    world, tp, pp, _, _ = LAYOUTS[layout]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    results = run_ranks(_failures, world, tp, pp, backend="nccl", timeout_s=420, pg_timeout_s=120)
    for r in results:
        expected = "ValueError" if r["rank"] == world - 1 else "PeerFailure"
        assert r["raised"] == expected, (layout, r)
        assert r["clean_after_failure"] and r["clean_after_abort"], (layout, r)
        assert r["double_begin"] == "TrainStepError" and r["still_open_and_nulled"], (layout, r)
        assert r["after_abort_equals_fresh"] == 0.0 and r["version"] == 2, (layout, r)


# -- through the data plane ------------------------------------------------------------------------
def _presharded(rank: int, world: int, url: str, shard: Any, rows: dict[str, Any], tp: int, pp: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    import dataplane
    from dataplane.observability import CallEvent, ObservedClient
    from integrations.rl.workers.megatron_tiny import TinyMegatronWorker

    ids = rows["input_ids"].cuda()
    out: dict[str, Any] = {"rank": rank}
    # the single-GPU forward of the same weights: TP = 1 on every rank
    policy1 = TinyMegatronWorker(_shape(), tp=1, seed=0)
    critic1 = TinyMegatronWorker(_shape("value"), tp=1, seed=1)
    with torch.no_grad():
        out["ref_logprobs"] = policy1.token_logprobs_of(ids).cpu()
        out["ref_values"] = critic1.token_values_of(ids).cpu()
    whole = [{k: p.detach().cpu() for k, p in w.model.named_parameters()} for w in (policy1, critic1)]
    del policy1, critic1
    ps.destroy_model_parallel()

    events: list[CallEvent] = []
    client = ObservedClient(dataplane.connect(url), events.append)
    try:
        policy = TinyMegatronWorker(_shape(), tp=tp, pp=pp, seed=0)
        critic = TinyMegatronWorker(_shape("value"), tp=tp, pp=pp, seed=1)
        if pp > 1:  # a stage draws its layers' initial weights in another order: load the whole model's
            for w, params in zip((policy, critic), whole, strict=True):
                _load_stage(w, params)
        for w in (policy, critic):
            w.setup_data_plane(client)
        out["leader"] = policy.is_writeback_leader()
        written = policy.get_logprobs_presharded(shard)
        stats = policy.last_fetch_stats
        out["fetch"] = None if stats is None else (stats.policy, stats.role, stats.group_size)
        out["written"] = None if written is None else list(written.fields)
        critic.get_values_presharded(shard)
        out["puts"] = [(e.op, e.n_keys) for e in events if e.op == "kv_batch_put"]
    finally:
        client.close()
    return out


def _load_stage(worker: Any, whole: dict[str, torch.Tensor]) -> None:
    """Copy a single-GPU model's parameters into this pipeline stage's (TP = 1): local layer i is
    global layer ``stage * layers_per_stage + i``."""
    import re

    from megatron.core import parallel_state as ps

    offset = ps.get_pipeline_model_parallel_rank() * (_shape().n_layers // ps.get_pipeline_model_parallel_world_size())
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            key = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
            p.copy_(whole[key].to(p.device))


@pytest.mark.mooncake
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_megatron_presharded_forwards_write_each_key_once_from_the_leader(layout: str) -> None:
    pytest.importorskip("mooncake.store", reason="needs Mooncake (pip install 'dataplane[mooncake-cuda]')")
    world, tp, pp, _, _ = LAYOUTS[layout]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    import dataplane
    from dataplane.columns import first_write, read_columns
    from dataplane.preshard import shard_meta_for_dp
    from dataplane.testing.ranks import run_ranks

    g = torch.Generator().manual_seed(3)
    n, width = 12, 24
    lengths = torch.randint(3, width + 1, (n,), generator=g).tolist()
    ids = torch.randint(1, 64, (n, width), generator=g)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
    mask = (ids > 0).long()
    with dataplane.connect("mooncake://local") as owner:
        meta = first_write(
            owner,
            {"input_ids": ids, "loss_mask": mask},
            uids=[f"p{i}" for i in range(n // 2)],
            group_size=2,
            partition_id="rl",
            token_fields=["input_ids", "loss_mask"],
            lengths=lengths,
        )
        (shard,) = shard_meta_for_dp(meta, 1, max_tokens_per_microbatch=96)
        assert len(shard.extra_info["microbatches"]) > 1, "the test wants several microbatches"
        results = run_ranks(
            _presharded,
            2,
            owner.url,
            shard,
            {"input_ids": ids},
            tp,
            pp,
            backend="nccl",
            timeout_s=420,
            pg_timeout_s=120,
        )
        got = read_columns(owner, meta, ["prev_logprobs", "values"], layout="jagged")
    leader, sibling = results
    assert leader["leader"] and not sibling["leader"]
    assert leader["written"] is not None and "prev_logprobs" in leader["written"] and sibling["written"] is None
    assert leader["fetch"] == ("leader_broadcast", "leader", 2) and sibling["fetch"] == (
        "leader_broadcast",
        "sibling",
        2,
    )
    assert sibling["puts"] == [], "only the leader writes"
    assert sum(k for _, k in leader["puts"]) == 2 * n, "logprobs and values: every key once"
    for i, length in enumerate(lengths):
        lp, v = got["prev_logprobs"][i], got["values"][i]
        assert lp.shape == (length,) and v.shape == (length,), "token-aligned: one value per token"
        torch.testing.assert_close(lp, leader["ref_logprobs"][i, :length], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, leader["ref_values"][i, :length], rtol=1e-5, atol=1e-5)
        assert float(lp[0]) == 0.0 and float(v[0]) == 0.0, "position 0 holds 0"
