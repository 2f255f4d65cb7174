"""``python -m benchmarks.hf_step``: a GRPO-shaped step of a Hugging Face model through the data plane.

One rank (one GPU, NCCL; or the CPU over gloo for a smoke run) builds
:class:`~integrations.rl.workers.hf.HFCausalLMWorker` from a config (random init, nothing
downloaded), writes ``--rows`` rows of ``--tokens`` tokens to the store, and times, after
``--warmup`` untimed rounds, ``--repeat`` rounds of

* ``get_logprobs_presharded`` (read ``input_ids``, forward in planned microbatches, write back) and
* ``train_presharded`` (read the loss's fields, forward and backward every microbatch, step),

with the seconds each spends in data-plane calls (the read and the write-back, the device synchronised
around them), tokens per second and peak GPU memory. Then the log-prob path alone on one
``--mb-tokens`` microbatch: forward and backward through the chunked path against the float32
``[B, T, V]`` path, peak memory above the model's resident state.

    python -m benchmarks.hf_step --model qwen2-0.5b --out docs/gpu-runs/<date>_H100_hf_step   # one GPU
    python -m benchmarks.hf_step --model tiny --device cpu --rows 8 --tokens 64                 # smoke run
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import dataplane
from benchmarks.harness import bench_main, machine_info
from dataplane.columns import first_write
from dataplane.preshard import shard_meta_for_dp
from integrations.rl.conventions import token_logprobs
from integrations.rl.losses import ClippedPolicyLoss


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["qwen2-0.5b", "tiny"], default="qwen2-0.5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", default="mooncake://local", help="data plane URL (memory:// if it cannot start)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per row (all rows full)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per row (no loss there)")
    p.add_argument("--mb-tokens", type=int, default=16384, help="max tokens per microbatch")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None, help="path without extension (.json, .md)")
    return p.parse_args(argv)


def _init_group(device: str) -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def _connect(url: str) -> tuple[Any, str, str | None]:
    try:
        return dataplane.connect(url), url, None
    except Exception as e:  # e.g. Mooncake's libraries missing on this host
        return dataplane.connect("memory://"), "memory://", f"{url} did not start: {type(e).__name__}: {e}"


class _Clock:
    """Seconds spent inside the wrapped data-plane calls (the device synchronised before and after)."""

    def __init__(self, sync: Any) -> None:
        self.seconds, self.sync = 0.0, sync

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds += time.perf_counter() - t0

        return timed


def run(args: argparse.Namespace) -> dict[str, Any]:
    from integrations.rl.workers.hf import HFCausalLMWorker, qwen2_0_5b_config, tiny_config

    _init_group(args.device)
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def peak_reset() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib() -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")

    config = qwen2_0_5b_config() if args.model == "qwen2-0.5b" else tiny_config("qwen2", vocab_size=512)
    t0 = time.perf_counter()
    worker = HFCausalLMWorker(
        config,
        device=args.device,
        precision="bf16",
        activation_checkpointing=args.activation_checkpointing,
        chunk_tokens=args.chunk_tokens,
        lr=1e-6,
    )
    build_s = time.perf_counter() - t0
    client, backend, fallback = _connect(args.backend)
    clock = _Clock(sync)
    for name in ("fetch_agreed", "write_back"):
        setattr(worker, name, clock.wrap(getattr(worker, name)))
    worker.setup_data_plane(client)

    g = torch.Generator().manual_seed(0)
    n, width, vocab = args.rows, args.tokens, int(config.vocab_size)
    ids = torch.randint(1, vocab, (n, width), generator=g)
    mask = torch.zeros(n, width, dtype=torch.int64)
    mask[:, args.prompt :] = 1
    fields = {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(n, generator=g)}
    meta = first_write(
        client,
        fields,
        uids=[f"u{i}" for i in range(n // 8)],
        group_size=8,
        partition_id="hf_step",
        token_fields=["input_ids", "loss_mask"],
        lengths=[width] * n,
    )
    shard = shard_meta_for_dp(meta, 1, max_tokens_per_microbatch=args.mb_tokens)[0]
    tokens = n * width
    rounds: list[dict[str, float]] = []
    for i in range(args.warmup + args.repeat):
        row: dict[str, float] = {}
        for what, call in (
            ("logprobs", lambda: worker.get_logprobs_presharded(shard)),
            ("train", lambda: worker.train_presharded(shard, ClippedPolicyLoss())),
        ):
            clock.seconds = 0.0
            sync()
            peak_reset()
            t0 = time.perf_counter()
            call()
            sync()
            row[f"{what}_s"] = time.perf_counter() - t0
            row[f"{what}_data_s"] = clock.seconds
            row[f"{what}_peak_gib"] = peak_gib()
        if i >= args.warmup:
            rounds.append(row)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    metrics = worker.forward_metrics
    head = _logprob_path_memory(worker, vocab, args, cuda, sync, peak_reset, peak_gib)
    client.close()
    dist.destroy_process_group()
    return {
        "benchmark": "hf_step",
        "machine": machine_info(gpus=cuda),
        "model": args.model,
        "config": {
            k: getattr(config, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
            )
        },
        "params": sum(p.numel() for p in worker.model.parameters()),
        "backend": backend,
        "backend_fallback": fallback,
        "rows": n,
        "tokens_per_row": width,
        "microbatches": len(shard.extra_info["microbatches"]),
        "activation_checkpointing": args.activation_checkpointing,
        "chunk_tokens": args.chunk_tokens,
        "build_s": build_s,
        "rounds": rounds,
        "median": med,
        "logprobs_tokens_per_s": tokens / med["logprobs_s"],
        "train_tokens_per_s": tokens / med["train_s"],
        "data_share_logprobs": med["logprobs_data_s"] / med["logprobs_s"],
        "data_share_train": med["train_data_s"] / med["train_s"],
        "data_share_step": (med["logprobs_data_s"] + med["train_data_s"]) / (med["logprobs_s"] + med["train_s"]),
        "real_token_share": metrics.get("real_token_share"),
        "logprob_path": head,
    }


def _logprob_path_memory(
    worker: Any, vocab: int, args: argparse.Namespace, cuda: bool, sync: Any, peak_reset: Any, peak_gib: Any
) -> dict[str, Any]:
    """Forward and backward of one ``--mb-tokens`` microbatch through the chunked path and through the
    float32 ``[B, T, V]`` path: peak memory above what was allocated before (the model's state)."""
    rows = max(1, args.mb_tokens // args.tokens)
    ids = torch.randint(1, vocab, (rows, args.tokens), device=worker.compute_device())
    model = worker.model
    model.train()
    out: dict[str, Any] = {"tokens": rows * args.tokens}

    def chunked() -> torch.Tensor:
        return model(ids)  # type: ignore[no-any-return]

    def whole() -> torch.Tensor:
        return token_logprobs(model(ids, output="logits").float(), ids)

    for name, fn in (("chunked", chunked), ("float32_logits", whole)):
        worker.optimizer.zero_grad(set_to_none=True)
        sync()
        base = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
        peak_reset()
        t0 = time.perf_counter()
        try:
            fn().sum().backward()  # type: ignore[no-untyped-call]
            sync()
            out[f"{name}_s"] = time.perf_counter() - t0
            out[f"{name}_peak_above_gib"] = peak_gib() - base
        except torch.OutOfMemoryError as e:
            out[f"{name}_error"] = f"out of memory: {str(e).splitlines()[0]}"
        worker.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    if "chunked_peak_above_gib" in out and "float32_logits_peak_above_gib" in out:
        out["ratio"] = out["chunked_peak_above_gib"] / out["float32_logits_peak_above_gib"]
    return out


def to_markdown(r: dict[str, Any]) -> str:
    m, med, head = r["machine"], r["median"], r["logprob_path"]
    gpus = "; ".join(m.get("gpus") or []) or "none"
    lines = [
        f"# {r['model']} on one rank: logprobs and a train step through the data plane",
        "",
        f"Machine: GPUs {gpus}, torch {m.get('torch')}, CUDA {m.get('cuda')}, transformers "
        f"{m.get('transformers', '?')}, Python {m.get('python')}, {m.get('cpu_count')} CPUs. Command: `{r['command']}`.",
        "",
        f"Model: {r['params'] / 1e6:.1f} M parameters ({r['config']}), bf16 mixed precision (fp32 master weights and "
        f"gradient reduction), FSDP2 on one rank, activation checkpointing {'on' if r['activation_checkpointing'] else 'off'}, "
        f"log-probs in chunks of {r['chunk_tokens']} tokens. Batch: {r['rows']} rows x {r['tokens_per_row']} tokens "
        f"in {r['microbatches']} microbatches, through `{r['backend']}`"
        + (f" ({r['backend_fallback']})" if r["backend_fallback"] else "")
        + f". Medians of {len(r['rounds'])} rounds after warm-up.",
        "",
        "| call | median s | tokens/s | data plane s | data share | peak GPU GiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for what in ("logprobs", "train"):
        lines.append(
            f"| {what} | {med[f'{what}_s']:.3f} | {r[f'{what}_tokens_per_s']:,.0f} | {med[f'{what}_data_s']:.4f} | "
            f"{r[f'data_share_{what}']:.2%} | {med[f'{what}_peak_gib']:.2f} |"
        )
    lines += [
        "",
        f"- data plane share of the step (logprobs + train): **{r['data_share_step']:.2%}** (target <= 5%)",
        f"- real tokens / computed tokens: {r['real_token_share']}",
        "",
        f"Log-prob path alone, forward and backward of one {head['tokens']:,}-token microbatch, peak memory above the "
        "model's resident state:",
        "",
        "| path | s | peak above GiB |",
        "| --- | --- | --- |",
    ]
    for name in ("chunked", "float32_logits"):
        if f"{name}_error" in head:
            lines.append(f"| {name} | - | {head[f'{name}_error']} |")
        else:
            lines.append(f"| {name} | {head[f'{name}_s']:.3f} | {head[f'{name}_peak_above_gib']:.2f} |")
    if "ratio" in head:
        lines += ["", f"- chunked / float32 [B, T, V]: **{head['ratio']:.3f}** (target <= 0.25)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
