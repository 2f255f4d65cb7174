"""``python -m benchmarks.gpu_path``: one GPU's data path, fetch to the GPU and write-back from it,
against the ceilings measured in the same run (``python -m benchmarks.worker_gpu`` runs it when one
GPU is there).

One process, no replica group. Per backend (``memory://``, ``mooncake://local``) and a ~``--gb`` GB
RL-shaped shard (int64 ids, bf16 log-probs, fp32 advantages, bool mask per token, long-tailed
lengths; an fp32 reward per row), medians of ``--repeat`` after ``--warmup``:

* ceilings: the store read alone (to the CPU, jagged), a pageable and a pinned host-to-device copy of
  the same bytes, a pinned device-to-host copy and the put alone of the write-back's bytes;
* ``fetch(device="cuda")`` jagged and padded, through the pinned pool (``after``) and with plain
  pageable copies (``data_plane_pinned="never"``: ``before``);
* ``write_back`` of a per-token fp32 result that lives on the GPU, after and before;
* the pool's pinned memory (peak in use, allocated, cap), and a bit-exact check of the fetch against
  a CPU fetch moved to the GPU.

Ratios: fetch GB/s over ``min(store read, pinned H2D)``; write-back over ``min(put, pinned D2H)``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import dataplane
from benchmarks.harness import bench_main, machine_info
from dataplane.worker import DataPlaneWorkerMixin
from dataplane.worker.pinned import process_pool

FIELDS = ["input_ids", "logprobs", "advantages", "mask", "reward"]


class _Worker(DataPlaneWorkerMixin):
    pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_path", description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--backends", default="memory://,mooncake://local")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _timed(fn: Any, warmup: int, repeat: int) -> float:
    out = []
    for i in range(warmup + repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _digest(td: Any) -> list[Any]:
    out = []
    for name in td.keys():
        v = td.get(name)
        parts = [v.values(), v.offsets()] if v.is_nested else [v]
        out.append((name, [(tuple(p.shape), str(p.dtype), p.reshape(-1).view(torch.uint8).cpu()) for p in parts]))
    return out


def _equal(a: Any, b: Any) -> bool:
    da, db = _digest(a), _digest(b)
    return len(da) == len(db) and all(
        x[0] == y[0] and all(p[:2] == q[:2] and torch.equal(p[2], q[2]) for p, q in zip(x[1], y[1], strict=True))
        for x, y in zip(da, db, strict=True)
    )


def _backend(
    url: str, keys: list[str], fields: dict[str, Any], nbytes: int, args: argparse.Namespace
) -> dict[str, Any]:
    cuda = torch.device("cuda", torch.cuda.current_device())
    w, r = args.warmup, args.repeat
    out: dict[str, Any] = {"url": url}
    with dataplane.connect(url) as client:
        meta = client.kv_batch_put(keys, fields, partition_id="bench")
        meta = meta.with_extra_info(pad_to_length=max(meta.sequence_lengths or (1,)))
        after, before = _Worker(), _Worker()
        before.data_plane_pinned = "never"
        for worker in (after, before):
            worker.setup_data_plane(client)
        s: dict[str, float] = {}
        s["store_read"] = _timed(lambda: client.kv_batch_get(meta, select_fields=FIELDS, layout="jagged"), w, r)
        host = torch.empty(nbytes, dtype=torch.uint8)
        host.fill_(1)
        pinned = host.pin_memory()
        s["pageable_h2d"] = _timed(lambda: host.to(cuda), w, r)
        s["pinned_h2d"] = _timed(lambda: pinned.to(cuda, non_blocking=True), w, r)
        for layout in ("jagged", "padded"):
            for name, worker in (("after", after), ("before", before)):
                s[f"fetch_{layout}_{name}"] = _timed(
                    lambda worker=worker, layout=layout: worker.fetch(
                        meta, select_fields=FIELDS, layout=layout, device=cuda
                    ),
                    w,
                    r,
                )
        want = before.fetch(meta, select_fields=FIELDS, layout="jagged", device="cpu").to(cuda)
        got = after.fetch(meta, select_fields=FIELDS, layout="jagged", device=cuda)
        padded_want = before.fetch(meta, select_fields=FIELDS, layout="padded", device="cpu").to(cuda)
        padded_got = after.fetch(meta, select_fields=FIELDS, layout="padded", device=cuda)
        out["bit_exact"] = _equal(got, want) and _equal(padded_got, padded_want)
        del want, padded_want, padded_got
        # write-back of a per-token fp32 result that lives on the GPU
        lp = got.get("logprobs")
        result = torch.nested.nested_tensor_from_jagged(lp.values().float() * 0.5, lp.offsets())  # type: ignore[attr-defined]
        wb_bytes = result.values().numel() * 4
        host_result = {"old": torch.nested.nested_tensor_from_jagged(result.values().cpu(), result.offsets().cpu())}  # type: ignore[attr-defined]
        s["put_alone"] = _timed(lambda: client.kv_batch_put(list(meta.keys), host_result, partition_id="bench"), w, r)
        dev = torch.empty(wb_bytes, dtype=torch.uint8, device=cuda)
        pinned_out = torch.empty(wb_bytes, dtype=torch.uint8, pin_memory=True)
        s["pinned_d2h"] = _timed(lambda: pinned_out.copy_(dev, non_blocking=True), w, r)
        for name, worker in (("after", after), ("before", before)):
            s[f"write_back_{name}"] = _timed(
                lambda worker=worker: worker.write_back(meta, {"old": result}, token_fields=[]), w, r
            )
        back = client.kv_batch_get(meta, select_fields=["old"], layout="jagged").get("old")
        out["write_back_bit_exact"] = bool(torch.equal(back.values(), result.values().cpu()))
        client.kv_clear(partition_id="bench")
    out["seconds"] = s
    gbps = {
        k: (wb_bytes if k in ("put_alone", "pinned_d2h") or k.startswith("write_back") else nbytes) / v / 1e9
        for k, v in s.items()
    }
    out["gbps"] = gbps
    fetch_ceiling = min(gbps["store_read"], gbps["pinned_h2d"])
    wb_ceiling = min(gbps["put_alone"], gbps["pinned_d2h"])
    out["ratios"] = {
        **{
            f"fetch_{lay}_{n}": gbps[f"fetch_{lay}_{n}"] / fetch_ceiling
            for lay in ("jagged", "padded")
            for n in ("after", "before")
        },
        **{f"write_back_{n}": gbps[f"write_back_{n}"] / wb_ceiling for n in ("after", "before")},
    }
    out["bytes"] = {"shard": nbytes, "write_back": wb_bytes}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.worker_gpu import BYTES_PER_TOKEN, make_shard

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_path needs a CUDA GPU")
    torch.cuda.set_device(0)
    keys, fields = make_shard(int(args.gb * 1e9 / BYTES_PER_TOKEN), args.rows)
    nbytes = sum(
        (v.values() if v.is_nested else v).numel() * (v.values() if v.is_nested else v).element_size()
        for v in fields.values()
    )
    results = [_backend(url, keys, fields, nbytes, args) for url in args.backends.split(",")]
    return {
        "benchmark": "gpu_path",
        "machine": machine_info(gpus=True),
        "config": {"gb": args.gb, "rows": args.rows, "warmup": args.warmup, "repeat": args.repeat},
        "pool": process_pool().stats(),
        "backends": results,
    }


def to_markdown(r: dict[str, Any]) -> str:
    m, pool = r["machine"], r["pool"]
    lines = [
        "# One GPU's data path: fetch to the GPU and write-back from it",
        "",
        f"Machine: GPUs {'; '.join(m.get('gpus') or [])}, torch {m.get('torch')}, CUDA {m.get('cuda')}, "
        f"{m.get('cpu_count')} CPUs. Command: `{r['command']}`. Medians of {r['config']['repeat']} after "
        f"{r['config']['warmup']} warm-up.",
        "",
        f"Pinned pool: cap {pool['cap_bytes'] >> 20} MiB in {pool['chunk_bytes'] >> 20} MiB chunks; peak in use "
        f"{pool['peak_bytes_in_use'] >> 20} MiB; allocated at the end {pool['allocated_bytes'] >> 20} MiB.",
        "",
        "| backend | what | GB/s | ratio to ceiling |",
        "| --- | --- | --- | --- |",
    ]
    for b in r["backends"]:
        g, ratio = b["gbps"], b["ratios"]
        for k in ("store_read", "pageable_h2d", "pinned_h2d", "put_alone", "pinned_d2h"):
            lines.append(f"| {b['url']} | {k} (ceiling input) | {g[k]:.2f} | |")
        for k in ratio:
            lines.append(f"| {b['url']} | {k} | {g[k]:.2f} | **{ratio[k]:.2f}** |")
        lines.append(
            f"| {b['url']} | bit-exact fetch / write-back | {b['bit_exact']} / {b['write_back_bit_exact']} | |"
        )
    lines += [
        "",
        "Targets: fetch (after) >= 0.8 of min(store read, pinned H2D); write-back (after) >= 0.8 of "
        "min(put alone, pinned D2H); pinned memory never above the cap.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
