"""``python -m benchmarks.verl_step``: one verl GRPO step's data path, over the verl facade against TransferQueue.

    python -m benchmarks.verl_step                     # 64 prompts x 8 samples, facade on mooncake://local and tq://, TransferQueue
    python -m benchmarks.verl_step --quick             # the smoke run (small, figures mean nothing)
    python -m benchmarks.verl_step --prompts 32 --contenders transferqueue,mooncake://local

Replays, through the ``transfer_queue`` module's API, the calls verl 0.9.1's V1 trainer makes in one
synchronous GRPO step (``verl/trainer/ppo/v1``: ``trainer_base.py``, ``replay_buffer.py``,
``agent_loop_tq.py``, and the worker bridge ``verl/utils/transferqueue_utils.py``), without verl
and without model compute, on verl-shaped rows: per-token ``prompts``, ``responses``,
``response_mask``, ``loss_mask``, ``input_ids``, ``position_ids`` (int64) and ``rm_scores`` (fp32),
long-tailed response lengths, and the dataloader's object columns. Phases:

1. ``rollout``: the prompts' tag-only put, then per prompt the status flips (``kv_put(tag=...)``)
   and one one-row put per sample (dense ``[1, L]``, as the agent loop sends them);
2. ``sample``: ``kv_list()`` of every partition and the prompts' clear (``ReplayBuffer``);
3. ``log_prob``: the worker path for 2 DP ranks (``async_kv_retrieve_meta``, ``async_get_data`` of
   every field the rows hold, ``async_put`` of ``log_probs`` and ``entropy``), then the driver's get
   and the ``old_log_probs`` put;
4. ``ref``: the same worker pass again, the driver's get and the ``ref_log_prob`` put;
5. ``advantage``: the get of seven fields (three of them never written: dropped) and the
   ``advantages``/``returns`` put;
6. ``update``: the worker path's get of every field, per DP rank;
7. ``clear``: the step's rows go.

Each contender runs in a process of its own (the facade replaces the name ``transfer_queue``):
``transferqueue`` is TransferQueue 0.1.11 itself (SimpleStorage, two storage units, on a local Ray),
any URL is the facade installed on it (``integrations.verl.install``). Every read is checked against
what was written (a checksum per field). Medians of ``--repeat`` steps after a warm-up step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import default_out, machine_info, machine_line, report_head, write_report
from benchmarks.workload import human_bytes, rollout_lengths

__all__ = ["PHASES", "main"]

PHASES = ("rollout", "sample", "log_prob", "ref", "advantage", "update", "clear")
CONTENDERS = ("transferqueue", "mooncake://local", "tq://?backend=simple")
DP = 2
PROMPT_LEN = 256


# -- the step (run in a contender's process) ------------------------------------------------------
def _rollout_rows(prompts: int, samples: int, mean_len: int, seed: int) -> list[tuple[str, str, int, int]]:
    """(uid, key, prompt length, response length) per trajectory, long-tailed response lengths."""
    rng = np.random.default_rng(seed)
    lengths = rollout_lengths(prompts * samples, mean_len, rng, max_len=8 * mean_len)
    return [
        (f"u{p}", f"u{p}_{s}_0", PROMPT_LEN, int(lengths[p * samples + s]))
        for p in range(prompts)
        for s in range(samples)
    ]


def _one_row(uid: str, lp: int, lr: int, gen: torch.Generator) -> Any:
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    prompts = torch.randint(0, 150_000, (1, lp), generator=gen)
    responses = torch.randint(0, 150_000, (1, lr), generator=gen)
    mask = torch.ones(1, lr, dtype=torch.int64)
    scores = torch.zeros(1, lr)
    scores[0, -1] = float(torch.rand(1, generator=gen))
    objects = {
        "uid": uid,
        "raw_prompt": [{"role": "user", "content": f"question {uid}"}],
        "data_source": "bench",
        "reward_model": {"ground_truth": uid},
        "num_turns": 2,
        "extra_fields": {"min_global_steps": 1, "max_global_steps": 1},
    }
    fields: dict[str, Any] = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": mask,
        "loss_mask": mask,
        "input_ids": torch.cat([prompts, responses], 1),
        "position_ids": torch.arange(lp + lr).view(1, -1),
        "rm_scores": scores,
    }
    fields |= {k: NonTensorStack(NonTensorData(v)) for k, v in objects.items()}
    return TensorDict(fields, batch_size=[1])


def _sum(t: Any) -> float:
    v = t.values() if t.is_nested else t
    return float(v.double().sum())


def _per_token(like: Any, scale: float) -> Any:
    return torch.nested.nested_tensor_from_jagged(like.values().float() * scale, like.offsets())


def step(tq: Any, rows: list[tuple[str, str, int, int]], partition: str, n: int) -> dict[str, float]:
    """One GRPO step's ``transfer_queue`` calls; seconds per phase."""
    from tensordict import TensorDict

    t: dict[str, float] = {}
    gen = torch.Generator().manual_seed(n)
    uids = list(dict.fromkeys(u for u, *_ in rows))
    t0 = time.perf_counter()
    tq.kv_batch_put(
        keys=uids,
        partition_id=partition,
        tags=[{"is_prompt": True, "status": "pending", "global_steps": n}] * len(uids),
    )
    want = 0.0
    for u in uids:
        tq.kv_put(key=u, partition_id=partition, tag={"status": "running"})
        for uid, key, lp, lr in (r for r in rows if r[0] == u):
            row = _one_row(uid, lp, lr, gen)
            want += float(row["responses"].double().sum())
            tag = {"status": "success", "prompt_len": lp, "response_len": lr, "seq_len": lp + lr, "global_steps": n}
            tq.kv_batch_put(keys=[key], partition_id=partition, fields=row, tags=[tag])
        tq.kv_put(key=u, partition_id=partition, tag={"status": "finished"})
    t["rollout"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    listing = tq.kv_list()[partition]
    keys = [k for k, tag in listing.items() if not tag.get("is_prompt")]
    tq.kv_clear(keys=uids, partition_id=partition)
    t["sample"] = time.perf_counter() - t0
    if keys != [k for _, k, *_ in rows]:
        raise AssertionError("the listing lost the put order")

    client = tq.get_client()

    async def workers(write: bool) -> float:
        meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        total = 0.0
        for part in meta.chunk(DP):  # each DP rank: read every field its rows hold, write back
            data = await client.async_get_data(part)
            total += _sum(data["responses"])
            if write:
                out = TensorDict(
                    {"log_probs": _per_token(data["input_ids"], -0.5), "entropy": _per_token(data["input_ids"], 0.1)},
                    batch_size=[part.size],
                )
                await client.async_put(data=out, metadata=part)
        return total

    def check(what: str, got: float) -> None:
        if not np.isclose(got, want, rtol=1e-9):
            raise AssertionError(f"{what}: read responses summing to {got}, wrote {want}")

    for phase, put_field in (("log_prob", "old_log_probs"), ("ref", "ref_log_prob")):
        t0 = time.perf_counter()
        check(phase, asyncio.run(workers(True)))
        data = tq.kv_batch_get(
            keys=keys, partition_id=partition, select_fields=["entropy", "log_probs", "response_mask"]
        )
        fields = {put_field: data["log_probs"]} | ({"entropy": data["entropy"]} if phase == "log_prob" else {})
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=TensorDict(fields, batch_size=[len(keys)]))
        t[phase] = time.perf_counter() - t0

    t0 = time.perf_counter()
    asked = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]
    data = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=asked)
    if sorted(data.keys()) != ["old_log_probs", "ref_log_prob", "response_mask", "rm_scores", "uid"]:
        raise AssertionError(f"the advantage get returned {sorted(data.keys())}")
    adv = _per_token(data["response_mask"], 1.0)
    tq.kv_batch_put(
        keys=keys,
        partition_id=partition,
        fields=TensorDict({"advantages": adv, "returns": adv}, batch_size=[len(keys)]),
    )
    t["advantage"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    check("update", asyncio.run(workers(False)))
    t["update"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tq.kv_clear(keys=keys, partition_id=partition)
    t["clear"] = time.perf_counter() - t0
    return t


def run_contender(contender: str, prompts: int, samples: int, mean_len: int, repeat: int) -> dict[str, Any]:
    """In this process: start the contender, one warm-up step and ``repeat`` measured ones."""
    if contender != "transferqueue":
        import integrations.verl

        integrations.verl.install(contender)
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    import transfer_queue as tq

    if contender == "transferqueue":
        tq.init()
    torch.set_num_threads(1)
    rows = _rollout_rows(prompts, samples, mean_len, seed=0)
    steps = [step(tq, rows, f"train{n}", n) for n in range(1 + repeat)][1:]
    tq.close()
    token_bytes = sum((lp + lr) * 8 * 2 + lr * (8 * 3 + 4) + lp * 8 for _, _, lp, lr in rows)
    return {
        "name": contender,
        "facade": bool(getattr(tq, "FACADE", False)),
        "trajectories": len(rows),
        "tokens": sum(lp + lr for _, _, lp, lr in rows),
        "rollout_bytes": token_bytes,
        "step_seconds": statistics.median(sum(s.values()) for s in steps),
        "phases": {p: statistics.median(s[p] for s in steps) for p in PHASES},
        "repeat": repeat,
    }


# -- the parent -----------------------------------------------------------------------------------
def _child(contender: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "benchmarks.verl_step", "--child", contender, "--prompts", str(args.prompts)]
    cmd += ["--samples", str(args.samples), "--mean-len", str(args.mean_len), "--repeat", str(args.repeat)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAPLANE_VERL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *[p for p in [os.environ.get("PYTHONPATH")] if p]])
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{contender}: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def to_markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    base = next((c for c in report["contenders"] if c["name"] == "transferqueue"), None)
    lines = report_head(
        f"One verl GRPO step's data path: the verl facade against TransferQueue ({report['date']})",
        f"{machine_line(report['machine'])} Command: `{report['command']}`. {cfg['prompts']} prompts x "
        f"{cfg['samples']} samples ({report['contenders'][0]['trajectories']} trajectories, "
        f"{human_bytes(report['contenders'][0]['rollout_bytes'])} of per-token fields), medians of "
        f"{cfg['repeat']} steps after a warm-up; each contender in a process of its own, one after the other.",
        ["contender", "step (s)", *PHASES, "vs TransferQueue"],
    )
    for c in report["contenders"]:
        name = c["name"] if c["name"] == "transferqueue" else f"facade on `{c['name']}`"
        ratio = f"{base['step_seconds'] / c['step_seconds']:.2f}x" if base else "-"
        phases = " | ".join(f"{c['phases'][p]:.3f}" for p in PHASES)
        lines.append(f"| {name} | {c['step_seconds']:.3f} | {phases} | {ratio} |")
    lines += ["", "`vs TransferQueue`: TransferQueue's step seconds over the contender's (above 1: faster)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.verl_step", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the smoke run: 4 prompts x 2 samples, 1 step")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 64)")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt (default 8)")
    p.add_argument("--mean-len", type=int, default=None, help="mean response tokens (default 1024)")
    p.add_argument("--repeat", type=int, default=None, help="measured steps after the warm-up (default 5)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated (default: all)")
    p.add_argument(
        "--json", default=None, metavar="PATH", help="the report (default: a dated one in benchmarks/reports)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.prompts = a.prompts or (4 if a.quick else 64)
    a.samples = a.samples or (2 if a.quick else 8)
    a.mean_len = a.mean_len or (64 if a.quick else 1024)
    a.repeat = a.repeat or (1 if a.quick else 5)
    return a


def main(argv: list[str] | None = None) -> int:
    import datetime

    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_contender(args.child, args.prompts, args.samples, args.mean_len, args.repeat)))
        return 0
    machine = machine_info()
    contenders = [_child(c, args) for c in args.contenders.split(",") if c]
    report = {
        "benchmark": "verl_step",
        "config": {k: getattr(args, k) for k in ("prompts", "samples", "mean_len", "repeat", "quick")},
        "contenders": contenders,
        "machine": machine,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.verl_step", *(sys.argv[1:] if argv is None else argv)]),
    }
    stem = Path(args.json).with_suffix("") if args.json else default_out("verl_step", machine)
    path = write_report(report, to_markdown(report), stem)
    print(to_markdown(report))
    print(f"wrote {path} and {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
