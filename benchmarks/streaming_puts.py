"""``python -m benchmarks.streaming_puts``: rows put one call at a time, as an asynchronous rollout
worker streams samples, on every installed backend.

Two parts, each on every backend:

- ``stream``: ``--puts`` single rows (a 100-token jagged field, a scalar and 16-wide dense fields,
  ``--fields`` in all) put one call each into one partition; milliseconds per put, averaged over each
  block of ``--block`` puts, from the first block to the last (a flat line: the cost of a put does
  not grow with what the partition holds). Then one get of every row, checked.
- ``rollouts``: ``--rollouts`` RL rollouts (7 token fields of 500-2,500 tokens and a reward) put one
  per call, then the trainer's get of all of them by keys and a data-parallel rank's get of every
  4th (each checked against what was put); the median put, and medians of ``--repeat`` gets after a
  warm-up, over ``--rounds`` rounds.

    python -m benchmarks.streaming_puts                       # every installed backend; a dated report
    python -m benchmarks.streaming_puts --backends "memory://" --puts 3000 --rollouts 256 --out /tmp/s
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.harness import add_out_argument, bench_main, machine_info, machine_line

ROLLOUT_DTYPES = (torch.int64, torch.int64, torch.float32, torch.float32, torch.float32, torch.bool, torch.bfloat16)


def default_backends() -> list[str]:
    """memory, and mooncake and TransferQueue where installed."""
    out = ["memory://"]
    if importlib.util.find_spec("mooncake") is not None:
        out.append("mooncake://local?segment_bytes=1GiB")
    if importlib.util.find_spec("transfer_queue") is not None and importlib.util.find_spec("ray") is not None:
        out.append("tq://?backend=simple")
    return out


def stream(client: Any, n: int, fields: int, block: int) -> list[float]:
    """Put ``n`` single rows of ``fields`` fields into one partition; seconds per put, averaged per
    ``block`` puts. Reads every row back (raising on a mismatch) and clears the partition."""
    if fields < 2:
        raise ValueError("fields must be >= 2 (a jagged field and a scalar)")
    row = torch.arange(100)
    out: list[float] = []
    last = time.perf_counter()
    try:
        for i in range(n):
            send: dict[str, torch.Tensor] = {
                "ids": torch.nested.as_nested_tensor([row + i], layout=torch.jagged),
                "r": torch.tensor([float(i)]),
            }
            for j in range(fields - 2):
                send[f"f{j}"] = torch.full((1, 16), float(j))
            client.kv_batch_put([f"s{i}"], send, partition_id="stream")
            if (i + 1) % block == 0:
                now = time.perf_counter()
                out.append((now - last) / block)
                last = now
        got = client.kv_batch_get([f"s{i}" for i in range(n)], partition_id="stream", select_fields=["ids", "r"])
        if got["r"].tolist() != [float(i) for i in range(n)] or got["ids"].values().numel() != 100 * n:
            raise AssertionError("the streamed rows did not read back as put")
        if int(got["ids"][n - 1][99]) != 99 + n - 1:
            raise AssertionError("the last streamed row did not read back as put")
    finally:
        client.kv_clear(partition_id="stream")
    return out


def rollouts(client: Any, n: int, repeat: int, seed: int = 0) -> dict[str, float]:
    """Put ``n`` rollouts one per call, then get all of them by keys, and every 4th; median seconds
    per put and per get (each get checked), and the bytes of a whole get."""
    g = torch.Generator().manual_seed(seed)
    keys = [f"r{i}" for i in range(n)]
    names = [f"t{j}" for j in range(len(ROLLOUT_DTYPES))]
    sent: list[dict[str, torch.Tensor]] = []
    puts: list[float] = []
    try:
        for i, key in enumerate(keys):
            length = int(torch.randint(500, 2501, (1,), generator=g))
            row: dict[str, torch.Tensor] = {"reward": torch.tensor([float(i)])}
            for name, dtype in zip(names, ROLLOUT_DTYPES, strict=True):
                values = torch.randint(0, 1000, (length,), generator=g).to(dtype)
                row[name] = torch.nested.as_nested_tensor([values], layout=torch.jagged)
            sent.append(row)
            t0 = time.perf_counter()
            client.kv_batch_put([key], row, partition_id="rollouts")
            puts.append(time.perf_counter() - t0)
        fields = ["reward", *names]
        out: dict[str, float] = {"put_s": statistics.median(puts)}
        for label, want in (("get_all_s", list(range(n))), ("get_quarter_s", list(range(0, n, 4)))):
            ks = [keys[i] for i in want]
            times = []
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                got = client.kv_batch_get(ks, partition_id="rollouts", select_fields=fields)
                times.append(time.perf_counter() - t0)
            if got["reward"].tolist() != [float(i) for i in want]:
                raise AssertionError(f"{label}: the rewards did not read back in the keys' order")
            for j, i in enumerate(want):
                for name in names:
                    if not torch.equal(got[name][j], sent[i][name][0]):
                        raise AssertionError(f"{label}: row {i} of {name} did not read back as put")
            out[label] = statistics.median(times[1:])
            if label == "get_all_s":
                out["bytes"] = float(sum((t.values() if t.is_nested else t).nbytes for t in got.values()))
        return out
    finally:
        client.kv_clear(partition_id="rollouts")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataplane

    machine = machine_info()
    results: dict[str, Any] = {}
    for url in args.backends:
        client = dataplane.connect(url)
        try:
            per_put = stream(client, args.puts, args.fields, args.block)
            rounds = [rollouts(client, args.rollouts, args.repeat, seed=seed) for seed in range(args.rounds)]
        finally:
            client.close()
        results[url] = {"stream_ms_per_put": [x * 1e3 for x in per_put], "rollouts": rounds}
        print(f"{url}: done", file=sys.stderr, flush=True)
    return {
        "benchmark": "streaming_puts",
        "config": {k: getattr(args, k) for k in ("puts", "fields", "block", "rollouts", "rounds", "repeat")},
        "machine": machine,
        "results": results,
    }


def to_markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    blocks = len(next(iter(report["results"].values()))["stream_ms_per_put"])
    lines = [
        "# Rows put one call at a time (an asynchronous rollout worker streaming samples)",
        "",
        machine_line(report["machine"]),
        "",
        f"## {c['puts']:,} single-row puts of {c['fields']} fields into one partition, ms per put, "
        f"averaged per {c['block']} puts",
        "",
        "| backend | " + " | ".join(f"puts {i * c['block'] + 1}-{(i + 1) * c['block']}" for i in range(blocks)) + " |",
        "| --- | " + " | ".join("---" for _ in range(blocks)) + " |",
    ]
    for url, r in report["results"].items():
        lines.append(f"| `{url}` | " + " | ".join(f"{x:.2f}" for x in r["stream_ms_per_put"]) + " |")
    lines += [
        "",
        f"## {c['rollouts']} rollouts (7 token fields of 500-2,500 tokens and a reward) put one per call, "
        f"then got back by keys: all of them, and every 4th (medians of {c['repeat']} after a warm-up)",
        "",
        "| backend | round | MB | put ms | get all ms | get 1/4 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for url, r in report["results"].items():
        for i, x in enumerate(r["rollouts"]):
            lines.append(
                f"| `{url}` | {i + 1} | {x['bytes'] / 1e6:.1f} | {x['put_s'] * 1e3:.2f} | "
                f"{x['get_all_s'] * 1e3:.1f} | {x['get_quarter_s'] * 1e3:.1f} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.streaming_puts", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backends", type=lambda s: s.split(";"), default=None, help="';'-separated URLs (default: every installed)"
    )
    p.add_argument("--puts", type=int, default=3000, help="single-row puts in the stream part")
    p.add_argument("--fields", type=int, default=8, help="fields of each streamed row (>= 2)")
    p.add_argument("--block", type=int, default=500, help="puts averaged per reported figure")
    p.add_argument("--rollouts", type=int, default=256, help="rollouts put one per call in the rollouts part")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the rollouts part (a new seed each)")
    p.add_argument("--repeat", type=int, default=5, help="timed gets after a warm-up, per round")
    add_out_argument(p)
    args = p.parse_args(argv)
    args.backends = args.backends or default_backends()
    if args.fields < 2 or args.block < 1 or args.puts < args.block or min(args.rollouts, args.rounds, args.repeat) < 1:
        p.error("--fields must be >= 2, --puts at least --block, and the rest positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, to_markdown)


if __name__ == "__main__":
    sys.exit(main())
