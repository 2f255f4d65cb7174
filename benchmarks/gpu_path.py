"""``python -m benchmarks.gpu_path``: one GPU's data path, fetch to the GPU and write-back from it,
against the ceilings measured in the same run (``python -m benchmarks.worker_gpu`` runs it when one
GPU is there).

One process, no replica group. Per backend (``memory://``, ``mooncake://local``) and a ~``--gb`` GB
RL-shaped shard (int64 ids, bf16 log-probs, fp32 advantages, bool mask per token, long-tailed
lengths; an fp32 reward per row), medians of ``--repeat`` after ``--warmup``:

* ceilings: the store read alone (to the CPU, jagged), a pageable and a pinned host-to-device copy of
  the same bytes, a host memcpy of them into pinned chunks (what one host copy costs), a pinned
  device-to-host copy and the put alone of the write-back's bytes;
* ``fetch(device="cuda")`` jagged and padded in three builds of the same code: ``before``
  (``data_plane_pinned="never"``: pageable ``.to(cuda)``), ``staged`` (``data_plane_direct=False``:
  the store read first, then copied through the pinned pool) and ``after`` (the default: the read
  lands in the pinned pool where the store allows it, else as ``staged``);
* the padding on the GPU alone (jagged columns on the GPU to the padded layout);
* ``write_back`` of a per-token fp32 result that lives on the GPU, in the same three builds;
* the pool's pinned memory (peak in use, allocated, cap), and a bit-exact check of every build's
  fetch against a CPU fetch moved to the GPU, and of every build's write-back.

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
from dataplane.codec.jagged import materialize
from dataplane.codec.wire import Layout
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
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: a dry run of every row (its figures mean nothing)",
    )
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any, warmup: int, repeat: int) -> float:
    out = []
    for i in range(warmup + repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _parts(td: Any) -> list[tuple[str, str, tuple[int, ...], str, torch.Tensor]]:
    """Every field's tensors (nested: values and offsets) as (field, part, shape, dtype, bytes)."""
    out = []
    for name in td.keys():
        v = td.get(name)
        parts = [("values", v.values()), ("offsets", v.offsets())] if v.is_nested else [("dense", v)]
        out += [(name, k, tuple(p.shape), str(p.dtype), p.reshape(-1).view(torch.uint8)) for k, p in parts]
    return out


def _equal(a: Any, b: Any) -> bool:
    """Bit-exact: the same fields, shapes, dtypes and bytes (compared where the tensors are)."""
    pa, pb = _parts(a), _parts(b)
    return len(pa) == len(pb) and all(
        x[:4] == y[:4] and x[4].device == y[4].device and torch.equal(x[4], y[4]) for x, y in zip(pa, pb, strict=True)
    )


BUILDS = ("after", "staged", "before")
LAYOUTS: tuple[Layout, ...] = ("jagged", "padded")


def _workers(client: Any, device: torch.device) -> dict[str, _Worker]:
    out = {name: _Worker() for name in BUILDS}
    out["before"].data_plane_pinned = "never"
    out["staged"].data_plane_direct = False
    if device.type == "cpu":  # the dry run: the pool on the CPU path
        out["staged"].data_plane_pinned = out["after"].data_plane_pinned = "always"
    for worker in out.values():
        worker.setup_data_plane(client)
    return out


def _copy_ceilings(nbytes: int, cuda: torch.device, w: int, r: int) -> dict[str, float]:
    """Pageable and pinned host-to-device copies of ``nbytes``, and a host memcpy of them into pinned
    chunks of the pool's size (what one host copy of the shard costs)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    pinned = host.pin_memory() if torch.cuda.is_available() else host.clone()
    chunk = process_pool().chunk_bytes

    def to_pinned() -> None:
        for o in range(0, nbytes, chunk):
            n = min(chunk, nbytes - o)
            pinned[:n].copy_(host[o : o + n])

    return {
        "pageable_h2d": _timed(lambda: host.to(cuda), w, r),
        "pinned_h2d": _timed(lambda: pinned.to(cuda, non_blocking=True), w, r),
        "host_to_pinned": _timed(to_pinned, w, r),
    }


def _d2h_ceiling(nbytes: int, cuda: torch.device, w: int, r: int) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=cuda)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return _timed(lambda: pinned.copy_(dev, non_blocking=True), w, r)


def _pad_on_gpu(td: Any, width: int) -> None:
    """The padded layout made from jagged fields already on the GPU (what a padded fetch adds)."""
    for name in td.keys():
        v = td.get(name)
        if v.is_nested:
            materialize(v.values(), v.offsets(), pad_to_length=width)


def _backend(
    url: str, keys: list[str], fields: dict[str, Any], nbytes: int, args: argparse.Namespace
) -> dict[str, Any]:
    cuda = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    w, r = args.warmup, args.repeat
    out: dict[str, Any] = {"url": url}
    with dataplane.connect(url) as client:
        meta = client.kv_batch_put(keys, fields, partition_id="bench")
        width = max(meta.sequence_lengths or (1,))
        meta = meta.with_extra_info(pad_to_length=width)
        workers = _workers(client, cuda)
        s: dict[str, float] = {}
        s["store_read"] = _timed(lambda: client.kv_batch_get(meta, select_fields=FIELDS, layout="jagged"), w, r)
        s.update(_copy_ceilings(nbytes, cuda, w, r))
        for layout in LAYOUTS:
            for name in BUILDS:
                s[f"fetch_{layout}_{name}"] = _timed(
                    lambda worker=workers[name], layout=layout: worker.fetch(
                        meta, select_fields=FIELDS, layout=layout, device=cuda
                    ),
                    w,
                    r,
                )
        plain = workers["before"]
        exact = {}
        for layout in LAYOUTS:
            want = plain.fetch(meta, select_fields=FIELDS, layout=layout, device="cpu").to(cuda)
            for name in BUILDS:
                got = workers[name].fetch(meta, select_fields=FIELDS, layout=layout, device=cuda)
                exact[f"{layout}_{name}"] = _equal(got, want)
        out["bit_exact"] = exact
        jagged = workers["after"].fetch(meta, select_fields=FIELDS, layout="jagged", device=cuda)
        s["pad_on_gpu"] = _timed(lambda: _pad_on_gpu(jagged, width), w, r)
        # write-back of a per-token fp32 result that lives on the GPU
        lp = jagged.get("logprobs")
        result = torch.nested.nested_tensor_from_jagged(lp.values().float() * 0.5, lp.offsets())  # type: ignore[attr-defined]
        wb_bytes = result.values().numel() * 4
        host_result = {"old": torch.nested.nested_tensor_from_jagged(result.values().cpu(), result.offsets().cpu())}  # type: ignore[attr-defined]
        s["put_alone"] = _timed(lambda: client.kv_batch_put(list(meta.keys), host_result, partition_id="bench"), w, r)
        s["pinned_d2h"] = _d2h_ceiling(wb_bytes, cuda, w, r)
        wb_exact = {}
        for name in BUILDS:
            s[f"write_back_{name}"] = _timed(
                lambda worker=workers[name]: worker.write_back(meta, {"old": result}, token_fields=[]), w, r
            )
            back = client.kv_batch_get(meta, select_fields=["old"], layout="jagged").get("old")
            wb_exact[name] = bool(torch.equal(back.values(), result.values().cpu()))
        out["write_back_bit_exact"] = wb_exact
        client.kv_clear(partition_id="bench")
    out["seconds"] = s
    wb_keys = ("put_alone", "pinned_d2h")
    gbps = {
        k: (wb_bytes if k in wb_keys or k.startswith("write_back") else nbytes) / v / 1e9
        for k, v in s.items()
        if k != "pad_on_gpu"
    }
    out["gbps"] = gbps
    fetch_ceiling = min(gbps["store_read"], gbps["pinned_h2d"])
    wb_ceiling = min(gbps["put_alone"], gbps["pinned_d2h"])
    out["ceilings"] = {"fetch": fetch_ceiling, "write_back": wb_ceiling}
    out["ratios"] = {
        **{
            f"fetch_{lay}_{n}": gbps[f"fetch_{lay}_{n}"] / fetch_ceiling for lay in ("jagged", "padded") for n in BUILDS
        },
        **{f"write_back_{n}": gbps[f"write_back_{n}"] / wb_ceiling for n in BUILDS},
    }
    out["bytes"] = {"shard": nbytes, "write_back": wb_bytes}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.worker_gpu import BYTES_PER_TOKEN, make_shard

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks.gpu_path needs a CUDA GPU (--device cpu: a dry run)")
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
        "config": {
            "gb": args.gb,
            "rows": args.rows,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "device": args.device,
        },
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
        for k in ("store_read", "pageable_h2d", "pinned_h2d", "host_to_pinned", "put_alone", "pinned_d2h"):
            note = "ceiling input" if k not in ("pageable_h2d", "host_to_pinned") else "for reference"
            lines.append(f"| {b['url']} | {k} ({note}) | {g[k]:.2f} | |")
        lines.append(
            f"| {b['url']} | pad_on_gpu (ms, padded layout from jagged on the GPU) | {b['seconds']['pad_on_gpu'] * 1e3:.1f} ms | |"
        )
        for k in ratio:
            lines.append(f"| {b['url']} | {k} | {g[k]:.2f} | **{ratio[k]:.2f}** |")
        exact = all(b["bit_exact"].values()) and all(b["write_back_bit_exact"].values())
        lines.append(f"| {b['url']} | bit-exact, every build: fetch (jagged, padded) and write-back | {exact} | |")
    lines += [
        "",
        "Targets: fetch (after) >= 0.8 of min(store read, pinned H2D); write-back (after) >= 0.8 of "
        "min(put alone, pinned D2H); pinned memory never above the cap. Builds: `before` pageable copies "
        '(`data_plane_pinned="never"`), `staged` the store read first, then copied through the pinned pool '
        "(`data_plane_direct=False`), `after` the default (the read lands in the pinned pool where the "
        "store allows it; write-back copies land in the client's `empty()` memory, which the put keeps or "
        "sends as it is).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
