"""Preshard quality and speed: token balance against textbook baselines, and planning time.

Quality: max-rank tokens / mean-rank tokens for 512 rows over 8 ranks with long-tailed (clipped
lognormal) lengths, for ``shard_meta_for_dp`` and for two baselines written here from the textbook
(sorted greedy / LPT, and Karmarkar-Karp largest differencing), over several seeds, with and without
equal row counts. Speed: median wall time of planning 4096 rows for 64 ranks, with and without a
token budget (target < 20 ms), beside CPU time and the load average, since wall time on a shared
machine is noisy.

    python -m benchmarks.preshard_quality                # writes a dated report in benchmarks/reports/
    python -m benchmarks.preshard_quality --quick --json /tmp/q.json
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import default_out, machine_info, machine_line, write_report
from dataplane import KVBatchMeta
from dataplane.preshard import plan_shards, shard_meta_for_dp

TARGET_MS = 20.0
DISTRIBUTIONS = {"lognormal_s1.0": (6.5, 1.0), "lognormal_s1.5": (6.0, 1.5)}


def long_tailed(n: int, seed: int, mu: float = 6.5, sigma: float = 1.0) -> list[int]:
    """Response lengths of an RL rollout: lognormal, clipped to [1, 32768] tokens."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(mu, sigma, n), 1, 32768)]


# -- textbook baselines (independent of dataplane.preshard) ---------------------------------------
def greedy_baseline(lengths: list[int], k: int, equal: bool) -> list[int]:
    """LPT: longest first onto the least-loaded rank (with ``equal``, only ranks below n/k rows)."""
    cap = -(-len(lengths) // k) if equal else len(lengths)
    loads, counts = [0] * k, [0] * k
    heap = [(0, g) for g in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        while counts[heap[0][1]] >= cap:
            heapq.heappop(heap)
        _, g = heapq.heappop(heap)
        loads[g] += lengths[i]
        counts[g] += 1
        heapq.heappush(heap, (loads[g], g))
    return loads


def kk_baseline(lengths: list[int], k: int, equal: bool) -> list[int]:
    """Karmarkar-Karp for k ways; with ``equal`` it starts from rounds of k sorted rows (verl style)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    starts = [order[s : s + k] for s in range(0, len(order), k)] if equal else [[i] for i in order]
    heap = []
    for t, members in enumerate(starts):
        sums = sorted([lengths[i] for i in members] + [0] * (k - len(members)), reverse=True)
        heapq.heappush(heap, (-(sums[0] - sums[-1]), t, sums))
    t = len(starts)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted((x + y for x, y in zip(a, reversed(b), strict=True)), reverse=True)
        heapq.heappush(heap, (-(merged[0] - merged[-1]), t, merged))
        t += 1
    return heap[0][2]


def imbalance(loads: list[int] | tuple[int, ...]) -> float:
    return max(loads) * len(loads) / sum(loads)


def quality(seeds: list[int], rows: int = 512, dp: int = 8) -> dict[str, Any]:
    per_seed = []
    for dist, (mu, sigma) in DISTRIBUTIONS.items():
        for equal in (False, True):
            for seed in seeds:
                lengths = long_tailed(rows, seed, mu, sigma)
                ours = imbalance(plan_shards(lengths, dp, equal_rows=equal).rank_tokens)
                greedy = imbalance(greedy_baseline(lengths, dp, equal))
                kk = imbalance(kk_baseline(lengths, dp, equal))
                per_seed.append(
                    {
                        "distribution": dist,
                        "equal_rows": equal,
                        "seed": seed,
                        "ours": round(ours, 6),
                        "greedy": round(greedy, 6),
                        "karmarkar_karp": round(kk, 6),
                        "ratio_to_best": round(ours / min(greedy, kk), 6),
                    }
                )
    return {
        "rows": rows,
        "dp_size": dp,
        "seeds": seeds,
        "metric": "max-rank tokens / mean-rank tokens (1.0 is perfect)",
        "distributions": {k: {"mu": mu, "sigma": s, "clip": [1, 32768]} for k, (mu, s) in DISTRIBUTIONS.items()},
        "per_seed": per_seed,
        "worst_ratio_to_best": max(r["ratio_to_best"] for r in per_seed),
        "target_ratio_to_best": 1.02,
    }


def _local_packing_count(lengths: list[int], budget: int) -> int:
    count, tokens = 0, None
    for x in lengths:
        if tokens is None or tokens + x > budget:
            count, tokens = count + 1, x
        else:
            tokens += x
    return count


def budgeted(seeds: list[int], rows: int = 512, dp: int = 8, budget: int = 16384) -> dict[str, Any]:
    """With a token budget: microbatches per rank (equal on every rank) against the lower bound
    ceil(tokens / (dp * budget)), and what per-rank local packing of the same shards would give."""
    per_seed = []
    for seed in seeds:
        lengths = long_tailed(rows, seed)
        plan = plan_shards(lengths, dp, max_tokens_per_microbatch=budget)
        assert plan.microbatches is not None
        local = [_local_packing_count([lengths[i] for i in sorted(r)], budget) for r in plan.rows]
        per_seed.append(
            {
                "seed": seed,
                "microbatches_per_rank": len(plan.microbatches[0]),
                "lower_bound": -(-sum(lengths) // (dp * budget)),
                "imbalance": round(plan.imbalance, 6),
                "local_packing_counts": local,
            }
        )
    return {"rows": rows, "dp_size": dp, "max_tokens_per_microbatch": budget, "per_seed": per_seed}


def _median_ms(fn: Any, repeat: int) -> tuple[list[float], list[float]]:
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return wall, cpu


def timing(repeat: int, rows: int = 4096, dp: int = 64) -> dict[str, Any]:
    lengths = long_tailed(rows, 0)
    meta = KVBatchMeta(partition_id="train", keys=[f"u{i}_g0" for i in range(rows)], sequence_lengths=lengths)
    cases = {
        "plan_no_budget": lambda: plan_shards(lengths, dp),
        "plan_budget_16k": lambda: plan_shards(lengths, dp, max_tokens_per_microbatch=16384),
        "plan_budget_16k_equal_rows": lambda: plan_shards(
            lengths, dp, max_tokens_per_microbatch=16384, equal_rows=True
        ),
        "shard_meta_no_budget": lambda: shard_meta_for_dp(meta, dp),
        "shard_meta_budget_16k": lambda: shard_meta_for_dp(meta, dp, max_tokens_per_microbatch=16384),
    }
    out = []
    for name, fn in cases.items():
        wall, cpu = _median_ms(fn, repeat)
        out.append(
            {
                "name": name,
                "median_ms": round(statistics.median(wall), 3),
                "min_ms": round(min(wall), 3),
                "max_ms": round(max(wall), 3),
                "cpu_median_ms": round(statistics.median(cpu), 3),
                "target_ms": TARGET_MS,
                "repeat": repeat,
            }
        )
    return {"rows": rows, "dp_size": dp, "lengths": "lognormal mu=6.5 sigma=1.0 seed 0", "cases": out}


def format_table(report: dict[str, Any]) -> str:
    q, t = report["quality"], report["timing"]
    lines = [f"quality: {q['rows']} rows x {q['dp_size']} ranks, max/mean tokens (lower is better)"]
    lines.append(f"{'distribution':<16}{'equal':>6}{'ours':>10}{'greedy':>10}{'KK':>10}{'ours/best':>11}")
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in q["per_seed"]:
        groups.setdefault((r["distribution"], r["equal_rows"]), []).append(r)
    for (dist, equal), rs in groups.items():
        mean = {k: statistics.fmean(r[k] for r in rs) for k in ("ours", "greedy", "karmarkar_karp")}
        worst = max(r["ratio_to_best"] for r in rs)
        lines.append(
            f"{dist:<16}{'yes' if equal else 'no':>6}{mean['ours']:>10.5f}{mean['greedy']:>10.5f}"
            f"{mean['karmarkar_karp']:>10.5f}{worst:>11.5f}"
        )
    lines.append(f"(means over seeds {q['seeds']}; ours/best is the worst seed; target <= {q['target_ratio_to_best']})")
    b = report["budget"]
    lines.append(
        f"\nwith a budget of {b['max_tokens_per_microbatch']} tokens: microbatches per rank / lower bound / local packing"
    )
    for r in b["per_seed"]:
        lines.append(
            f"  seed {r['seed']}: {r['microbatches_per_rank']} / {r['lower_bound']} / {r['local_packing_counts']}"
        )
    lines.append(f"\nplanning: {t['rows']} rows x {t['dp_size']} ranks (target < {TARGET_MS:g} ms median)")
    for c in t["cases"]:
        lines.append(
            f"{c['name']:<30}{c['median_ms']:>9.2f} ms  (cpu {c['cpu_median_ms']:.2f} ms, min {c['min_ms']:.2f})"
        )
    lines.append(f"load average at the end: {report['machine'].get('loadavg')}")
    return "\n".join(lines)


def to_markdown(report: dict[str, Any]) -> str:
    return (
        "# Preshard: token balance against textbook baselines, and planning time\n\n"
        f"{machine_line(report['machine'])}\n\n```\n{format_table(report)}\n```\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.preshard_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="seeds per distribution and mode (default 10)")
    p.add_argument("--repeat", type=int, default=31, help="timed runs per planning case (default 31)")
    p.add_argument("--quick", action="store_true", help="3 seeds, 5 timed runs")
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="where to write the report, and its markdown beside it (default: a dated report in benchmarks/reports/)",
    )
    args = p.parse_args(argv)
    seeds, repeat = (3, 5) if args.quick else (args.seeds, args.repeat)
    report = {
        "benchmark": "preshard_quality",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.preshard_quality", *(sys.argv[1:] if argv is None else argv)]),
        "quality": quality(list(range(seeds))),
        "budget": budgeted(list(range(seeds))),
        "timing": timing(repeat),
        "machine": machine_info(),
    }
    print(format_table(report))
    out = Path(args.json) if args.json else default_out("preshard_quality", report["machine"]).with_suffix(".json")
    write_report(report, to_markdown(report), out)
    print(f"wrote {out} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
