"""``python -m benchmarks.weight_sync``: what one weight sync costs, trainer group -> rollout engine.

A trainer group of ``--dp`` FSDP2 ranks (:class:`~integrations.rl.workers.hf.HFCausalLMWorker`,
random init from a config, nothing downloaded) on a local Ray, and a rollout actor with an
:class:`~integrations.rl.engines.HFEngine` holding an unsharded copy of the same model: after
``--warmup`` untimed syncs, ``--repeat`` syncs through
:class:`~integrations.rl.weight_sync.ObjectStoreWeightSync` (rank 0 gathers the whole parameters into
Ray's object store; the rollout actor loads them by name; the driver passes a ref), each timed whole
and in its two halves: gather + put (``state_dict_ref`` until the ref is ready) and load
(``load_weights`` with the ref). Medians; the bytes moved are the float32 parameters.

    python -m benchmarks.weight_sync --model tiny --out benchmarks/reports/<date>_weight_sync_tiny
    python -m benchmarks.weight_sync --model qwen2-0.5b --dp 2 --repeat 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

from benchmarks.harness import bench_main, machine_info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_sync", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["tiny", "qwen2-0.5b"], default="tiny")
    p.add_argument("--dp", type=int, default=2, help="trainer ranks (CPU, gloo)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--in-process",
        action="store_true",
        help="one process, no Ray: a one-rank trainer and the engine side by side (--device cuda: both on the GPU, "
        "bf16 compute), timing the gather to host memory and the load into the engine",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--in-process only")
    p.add_argument("--out", default=None, help="path without extension (.json, .md)")
    return p.parse_args(argv)


def _config(model: str) -> Any:
    from integrations.rl.workers.hf import qwen2_0_5b_config, tiny_config

    return qwen2_0_5b_config() if model == "qwen2-0.5b" else tiny_config("qwen2", vocab_size=32)


def _engine(model: str) -> Any:
    from integrations.rl.engines import HFEngine
    from integrations.rl.workers.hf import CausalLMPolicy, load_causal_lm

    return HFEngine(CausalLMPolicy(load_causal_lm(_config(model), seed=1)))


def _timings(n_params: int, repeat: int, total: list[float], put: list[float], load: list[float]) -> dict[str, Any]:
    """The report's figures: medians of each part, and the float32 bytes a sync moved per second."""
    return {
        "parameters": n_params,
        "bytes": n_params * 4,
        "repeat": repeat,
        "sync_seconds": statistics.median(total),
        "gather_put_seconds": statistics.median(put),
        "load_seconds": statistics.median(load),
        "gbytes_per_second": n_params * 4 / statistics.median(total) / 1e9,
    }


def run_in_process(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.hf_step import _init_group
    from integrations.rl.engines import HFEngine
    from integrations.rl.workers.dtensor import full_parameters
    from integrations.rl.workers.hf import CausalLMPolicy, HFCausalLMWorker, load_causal_lm

    cuda = args.device == "cuda"
    _init_group(args.device)
    worker = HFCausalLMWorker(_config(args.model), precision="bf16" if cuda else "fp32", device=args.device)
    engine = HFEngine(
        CausalLMPolicy(load_causal_lm(_config(args.model), seed=1)),
        device=args.device,
        dtype=torch.bfloat16 if cuda else torch.float32,
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    total, put, load = [], [], []
    for i in range(args.warmup + args.repeat):
        sync()
        t0 = time.perf_counter()
        params = full_parameters(worker.model)
        sync()
        t1 = time.perf_counter()
        engine.load_weights(params, i)
        sync()
        t2 = time.perf_counter()
        if i >= args.warmup:
            total.append(t2 - t0)
            put.append(t1 - t0)
            load.append(t2 - t1)
    n_params = sum(p.numel() for p in params.values())
    mean_gap, max_gap = _agreement(worker, engine, args.device)
    return {
        "benchmark": f"weight_sync_{args.model}_in_process_{args.device}",
        "machine": machine_info(gpus=cuda),
        "model": args.model,
        "dp": 1,
        "in_process": True,
        "device": args.device,
        **_timings(int(n_params), args.repeat, total, put, load),
        "sampler_logprob_diff": mean_gap,
        "sampler_logprob_diff_max": max_gap,
    }


def _agreement(worker: Any, engine: Any, device: str) -> tuple[float, float]:
    """After a sync: the engine samples 8 prompts x 2 completions of 32 tokens; the trainer's forward
    (its own precision) scores the same tokens; the mean and max |difference| of the log-probs."""
    import torch

    from integrations.rl.engines import SamplingParams

    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    prompts = [torch.randint(1, vocab, (16,), generator=g).tolist() for _ in range(8)]
    outs = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=32), seeds=list(range(8)))
    gaps = []
    with torch.no_grad():
        for prompt, group in zip(prompts, outs, strict=True):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids.tolist()], device=device)
                lp = worker.model(ids)[0, len(prompt) :].float().cpu()
                gaps.append((lp - c.logprobs).abs())
    every = torch.cat(gaps)
    return float(every.mean()), float(every.max())


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.in_process:
        return run_in_process(args)
    import ray

    from dataplane.local_ray import init_local_ray
    from integrations.rl.policy import Policy, gather
    from integrations.rl.rollout_actor import RolloutActor
    from integrations.rl.workers.hf import HFCausalLMWorker

    init_local_ray(num_cpus=max(4, args.dp + 2), log_to_driver=False)
    factory = functools.partial(HFCausalLMWorker, _config(args.model), precision="fp32", seed=0)
    policy = Policy.spawn({"policy": factory}, dp=args.dp, num_cpus=0.5)
    rollout = ray.remote(RolloutActor).options(num_cpus=0.5).remote(functools.partial(_engine, args.model))
    try:
        digest = policy.param_digest()
        total, put, load = [], [], []
        for i in range(args.warmup + args.repeat):
            t0 = time.perf_counter()
            ref = policy.state_dict_ref()
            ray.wait([ref], timeout=600, fetch_local=False)
            t1 = time.perf_counter()
            gather([rollout.load_weights.remote(ref, i)], timeout_s=600, what="load", names=["rollout"])
            t2 = time.perf_counter()
            del ref
            if i >= args.warmup:
                total.append(t2 - t0)
                put.append(t1 - t0)
                load.append(t2 - t1)
        n_params = ray.get(rollout.__ray_call__.remote(lambda a: sum(p.numel() for p in a.model.parameters())))
    finally:
        policy.shutdown()
        ray.kill(rollout, no_restart=True)
    return {
        "benchmark": f"weight_sync_{args.model}",
        "model": args.model,
        "dp": args.dp,
        **_timings(int(n_params), args.repeat, total, put, load),
        "policy_sha256": digest.sha256,
    }


def report(result: dict[str, Any]) -> str:
    r = result
    how = (
        f"one process on {r['device']}, no Ray: gather = full parameters to host memory, load = into the engine"
        if r.get("in_process")
        else f"dp={r['dp']} over Ray: gather + put = rank 0's ref ready in the object store"
    )
    return (
        f"# Weight sync, trainer group -> HF engine ({r['model']}; {how})\n\n"
        f"{r['parameters']:,} parameters ({r['bytes'] / 1e6:,.1f} MB in float32), median of {r['repeat']}:\n\n"
        "| sync | gather + put | load | GB/s |\n| --- | --- | --- | --- |\n"
        f"| {r['sync_seconds']:.3f} s | {r['gather_put_seconds']:.3f} s | {r['load_seconds']:.3f} s | "
        f"{r['gbytes_per_second']:.2f} |\n"
    ) + (
        f"\nAfter a sync, the engine's log-probs of 512 sampled tokens against the trainer's forward: mean "
        f"|diff| {r['sampler_logprob_diff']:.2e}, max {r['sampler_logprob_diff_max']:.2e}.\n"
        if "sampler_logprob_diff" in r
        else ""
    )


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
