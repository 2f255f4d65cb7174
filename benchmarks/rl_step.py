"""``python -m benchmarks.rl_step``: what the data plane saves in one RL step, against the driver funnel.

    python -m benchmarks.rl_step                       # 64 MB and 512 MB batches, every installed backend
    python -m benchmarks.rl_step --quick               # the smoke run (small, figures mean nothing)
    python -m benchmarks.rl_step --sizes 64 --json step.json --plot step.png

Replays the data movement of one GRPO step, without model compute, between one rollout process,
the driver (this process) and four trainer ranks (dp=2 x tp=2, one gloo group: a DP rank's TP
sibling gets its shard from its leader by broadcast). Rows are RL-shaped: long-tailed lengths (1,024
tokens on average, at most 8,192), ``input_ids`` int64, ``loss_mask`` bool, ``gen_logprobs`` and
``ref_logprobs`` fp32 per token, ``reward`` fp32 per row. Phases:

1. ``rollout_write``: the rollout process writes the batch;
2. ``advantages``: the driver reads ``reward`` and writes per-row ``advantages`` (GRPO's group-normalised);
3. ``logprobs``: each DP leader reads its shard's ``input_ids`` and ``loss_mask``, broadcasts them to
   its TP sibling and writes ``prev_logprobs`` (per token) back;
4. ``train``: each DP leader reads five fields (``input_ids``, ``loss_mask``, ``prev_logprobs``,
   ``ref_logprobs``, ``advantages``) and broadcasts them;
5. ``clear``: the step's rows go.

Contenders, in the same run, on the same processes, the same batch, in turns (so ratios are paired):
every installed multi-process backend (``mooncake://local``, ``tq://?backend=simple``,
``tq://?backend=mooncake``) through the worker mixin, and the **driver funnel** (how trainers without
a data plane move batches): the driver ``ray.get``\\ s the rollout's batch, cuts each DP shard's rows
out of it and ``ray.put``\\ s them (the TP siblings get the same ref), and gathers ``prev_logprobs``
back from the leaders. Both sides move the rows jagged (no padding), so the funnel pays for funnelling
only. Every step checks what the trainers read against the rollout's rows (a checksum per field).

Per contender and size: median seconds per phase and per step (after a warm-up step), the ratio to
the funnel (paired medians), the bytes that passed through the driver process and the driver's peak
RSS growth during a step. The report goes to ``--json`` (default a dated report in
``benchmarks/reports/``) with a markdown beside it and a PNG (``--plot``) of the phase times.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

import dataplane
from benchmarks.harness import default_out, machine_info, machine_line, paired, report_head, write_report
from benchmarks.workload import human_bytes, rollout_lengths
from dataplane import KVBatchMeta
from dataplane.codec import offsets_from_lengths
from dataplane.columns import first_write
from dataplane.preshard import shard_meta_for_dp
from dataplane.worker.mixin import DataPlaneWorkerMixin
from integrations.rl.advantages import group_advantages

__all__ = ["PHASES", "main", "run"]

DP, TP = 2, 2
GROUP = 8  # samples per prompt
MEAN_LEN, MAX_LEN = 1024, 8192
ROLLOUT_FIELDS = ("input_ids", "loss_mask", "gen_logprobs", "ref_logprobs")  # per token; plus reward
LOGPROB_FIELDS = ("input_ids", "loss_mask")
TRAIN_FIELDS = ("input_ids", "loss_mask", "prev_logprobs", "ref_logprobs", "advantages")
PHASES = ("rollout_write", "advantages", "logprobs", "train", "clear")
BYTES_PER_TOKEN = 8 + 1 + 4 + 4
FUNNEL = "driver_funnel"
BACKENDS = ("mooncake://local", "tq://?backend=simple", "tq://?backend=mooncake")
MB = 1 << 20
STEP_TIMEOUT_S = 600.0  # the most one phase's calls may take (ray.get raises GetTimeoutError past it)


# -- the batch --------------------------------------------------------------------------------------
def batch_rows(size_bytes: int) -> int:
    """Rows of a batch of about ``size_bytes`` (whole groups, an even split over DP)."""
    unit = GROUP * DP
    return max(unit, size_bytes // (BYTES_PER_TOKEN * MEAN_LEN) // unit * unit)


def make_rollout(size_bytes: int, seed: int = 0) -> TensorDict:
    """About ``size_bytes`` of rollout rows, jagged (nested tensors) per token, ``reward`` per row."""
    rows = batch_rows(size_bytes)
    rng = np.random.default_rng(seed)
    lengths = torch.from_numpy(rollout_lengths(rows, size_bytes / BYTES_PER_TOKEN / rows, rng, max_len=MAX_LEN))
    offsets = offsets_from_lengths(lengths)
    n = int(offsets[-1])
    g = torch.Generator().manual_seed(seed)
    flat = {
        "input_ids": torch.randint(0, 150_000, (n,), generator=g),
        "loss_mask": torch.rand(n, generator=g) > 0.1,
        "gen_logprobs": -torch.rand(n, generator=g),
        "ref_logprobs": -torch.rand(n, generator=g),
    }
    fields: dict[str, Any] = {k: torch.nested.nested_tensor_from_jagged(v, offsets) for k, v in flat.items()}
    fields["reward"] = torch.rand(rows, generator=g)
    return TensorDict(fields, batch_size=[rows])


def checksum(t: torch.Tensor) -> float:
    """A field's checksum (float64 sum of its values: the same rows in another order or split sum alike)."""
    v = t.values() if t.is_nested else t
    return float(v.double().sum())


def advantages_of(reward: torch.Tensor) -> torch.Tensor:
    """GRPO's group-normalised advantages of a batch of ``GROUP``-sample groups (one per row)."""
    return group_advantages(reward, torch.arange(reward.shape[0]) // GROUP)


def fake_logprobs(loss_mask: torch.Tensor) -> torch.Tensor:
    """What stands in for the forward: a per-token fp32 field from the shard's ``loss_mask``."""
    return torch.nested.nested_tensor_from_jagged(loss_mask.values().float() * -0.5, loss_mask.offsets())


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of a jagged or per-row tensor (jagged stays jagged)."""
    if not t.is_nested:
        return t[torch.tensor(rows, dtype=torch.int64)]
    off = t.offsets().tolist()
    values = t.values()
    parts = [values[off[i] : off[i + 1]] for i in rows]
    offsets = offsets_from_lengths([off[i + 1] - off[i] for i in rows])
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets)


def nbytes(t: Any) -> int:
    if isinstance(t, TensorDict):
        return sum(nbytes(v) for v in t.values())
    v = t.values() if t.is_nested else t
    return int(v.numel() * v.element_size())


def close_all(clients: Any) -> None:
    """Close clients in parallel (closing a Mooncake client takes about a second)."""
    threads = [threading.Thread(target=c.close) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


# -- the processes ----------------------------------------------------------------------------------
class RolloutProc:
    """The rollout process: builds a batch once per size, then writes it (or hands it over) each step."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.data = TensorDict({}, batch_size=[0])
        self.clients: dict[str, Any] = {}

    def connect(self, urls: list[str]) -> None:
        """Use a client of each URL (closing those of an earlier round)."""
        self.close()
        self.clients = {u: dataplane.connect(u) for u in urls}

    def build(self, size_bytes: int) -> dict[str, float]:
        """A batch of about ``size_bytes``; its checksums per field."""
        self.data = TensorDict({}, batch_size=[0])  # the old one goes first
        self.data = make_rollout(size_bytes)
        return {k: checksum(v) for k, v in self.data.items()}

    def write(self, url: str, partition: str) -> KVBatchMeta:
        return first_write(
            self.clients[url],
            self.data,
            uids=[f"u{i}" for i in range(self.data.batch_size[0] // GROUP)],
            group_size=GROUP,
            partition_id=partition,
            token_fields=ROLLOUT_FIELDS,
            lengths=self.data["input_ids"].offsets().diff(),
        )

    def batch(self) -> TensorDict:
        return self.data

    def close(self) -> None:
        close_all(self.clients.values())
        self.clients = {}


class Rank(DataPlaneWorkerMixin):
    """One trainer rank of the dp x tp gloo group; the TP siblings of a DP rank form its replica group."""

    def __init__(self, rank: int) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.clients: dict[str, Any] = {}
        self._group: Any = None

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def join(self, port: int) -> None:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=DP * TP,
            timeout=timedelta(seconds=300),
        )
        for d in range(DP):  # every rank creates every group, in the same order
            group = dist.new_group([d * TP + t for t in range(TP)])
            if self.rank // TP == d:
                self._group = group

    def connect(self, urls: list[str]) -> None:
        """Use a client of each URL (closing those of an earlier round)."""
        self.close()
        self.clients = {u: dataplane.connect(u) for u in urls}

    def replica_group(self) -> Any:
        return self._group

    def _use(self, url: str) -> None:
        self.setup_data_plane(self.clients[url])  # not owned: closed in close()

    def logprobs(self, url: str, shard: KVBatchMeta) -> dict[str, float]:
        self._use(url)
        got = self.fetch(shard, select_fields=list(LOGPROB_FIELDS), layout="jagged", policy="leader_broadcast")
        self.write_back(shard, {"prev_logprobs": fake_logprobs(got["loss_mask"])}, token_fields=[])
        return {k: checksum(got[k]) for k in LOGPROB_FIELDS}

    def train(self, url: str, shard: KVBatchMeta) -> dict[str, float]:
        self._use(url)
        got = self.fetch(shard, select_fields=list(TRAIN_FIELDS), layout="jagged", policy="leader_broadcast")
        return {k: checksum(got[k]) for k in TRAIN_FIELDS}

    def logprobs_inline(self, data: TensorDict) -> tuple[dict[str, float], torch.Tensor | None]:
        sums = {k: checksum(data[k]) for k in LOGPROB_FIELDS}
        return sums, (fake_logprobs(data["loss_mask"]) if self.rank % TP == 0 else None)  # the leader's back

    def train_inline(self, data: TensorDict) -> dict[str, float]:
        return {k: checksum(data[k]) for k in TRAIN_FIELDS}

    def close(self) -> None:
        self.close_data_plane()
        close_all(self.clients.values())
        self.clients = {}


# -- one step per contender -------------------------------------------------------------------------
class _RssPeak:
    """The driver's peak resident memory above its level at the start, sampled every 2 ms."""

    def __init__(self) -> None:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _check(what: str, got: list[dict[str, float]], want: dict[str, float]) -> None:
    """Every field's checksum summed over the DP leaders equals the batch's (and siblings saw their leader's)."""
    for k, v in want.items():
        total = sum(g[k] for g in got[::TP])
        if not np.isclose(total, v, rtol=1e-9, atol=1e-6):
            raise AssertionError(f"{what}: the trainers read {k} summing to {total}, the batch's sum to {v}")
        for d in range(DP):
            if any(got[d * TP + t][k] != got[d * TP][k] for t in range(TP)):
                raise AssertionError(f"{what}: a TP sibling of DP rank {d} read other {k} than its leader")


def step_dataplane(
    url: str, client: Any, rollout: Any, ranks: list[Any], want: dict[str, float], n: int
) -> dict[str, float]:
    import ray

    t: dict[str, float] = {}
    partition = f"rl-step-{n}"
    t0 = time.perf_counter()
    meta = ray.get(rollout.write.remote(url, partition), timeout=STEP_TIMEOUT_S)
    t["rollout_write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    adv = advantages_of(client.kv_batch_get(meta, select_fields="reward")["reward"])
    client.kv_batch_put(list(meta.keys), {"advantages": adv}, partition_id=partition)
    meta = meta.with_fields(["advantages"])
    t["advantages"] = time.perf_counter() - t0
    shards = shard_meta_for_dp(meta, DP)
    t0 = time.perf_counter()
    got = ray.get([r.logprobs.remote(url, shards[i // TP]) for i, r in enumerate(ranks)], timeout=STEP_TIMEOUT_S)
    t["logprobs"] = time.perf_counter() - t0
    _check("logprobs", got, {k: want[k] for k in LOGPROB_FIELDS})
    shards = [s.with_fields(["prev_logprobs", "advantages"]) for s in shards]
    t0 = time.perf_counter()
    got = ray.get([r.train.remote(url, shards[i // TP]) for i, r in enumerate(ranks)], timeout=STEP_TIMEOUT_S)
    t["train"] = time.perf_counter() - t0
    _check("train", got, {k: want[k] for k in TRAIN_FIELDS})
    t0 = time.perf_counter()
    client.kv_clear(partition_id=partition)
    t["clear"] = time.perf_counter() - t0
    return t


def step_funnel(rollout: Any, ranks: list[Any], want: dict[str, float]) -> tuple[dict[str, float], int]:
    """The same phases with the batch through the driver; the times and the bytes the driver moved."""
    import ray

    t: dict[str, float] = {}
    t0 = time.perf_counter()
    data = ray.get(rollout.batch.remote(), timeout=STEP_TIMEOUT_S)
    moved = nbytes(data)
    t["rollout_write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    data["advantages"] = advantages_of(data["reward"])
    t["advantages"] = time.perf_counter() - t0
    lengths = data["input_ids"].offsets().diff().tolist()
    meta = KVBatchMeta(partition_id=FUNNEL, keys=[str(i) for i in range(len(lengths))], sequence_lengths=lengths)
    rows = [[int(k) for k in s.keys] for s in shard_meta_for_dp(meta, DP)]  # the data plane's split

    def scatter(batch: TensorDict, fields: tuple[str, ...]) -> list[Any]:
        nonlocal moved
        refs = []
        for r in rows:
            part = TensorDict({f: take_rows(batch[f], r) for f in fields}, batch_size=[len(r)])
            moved += nbytes(part)
            refs.append(ray.put(part))
        return refs

    t0 = time.perf_counter()
    refs = scatter(data, LOGPROB_FIELDS)
    out = ray.get([r.logprobs_inline.remote(refs[i // TP]) for i, r in enumerate(ranks)], timeout=STEP_TIMEOUT_S)
    values = torch.empty(int(data["input_ids"].offsets()[-1]), dtype=torch.float32)  # back in batch order
    off = data["input_ids"].offsets().tolist()
    for d, r in enumerate(rows):
        prev = out[d * TP][1]
        moved += nbytes(prev)
        pv, po = prev.values(), prev.offsets().tolist()
        for j, i in enumerate(r):
            values[off[i] : off[i + 1]] = pv[po[j] : po[j + 1]]
    data["prev_logprobs"] = torch.nested.nested_tensor_from_jagged(values, data["input_ids"].offsets())
    t["logprobs"] = time.perf_counter() - t0
    _check("logprobs (funnel)", [o[0] for o in out], {k: want[k] for k in LOGPROB_FIELDS})
    t0 = time.perf_counter()
    refs = scatter(data, TRAIN_FIELDS)
    got = ray.get([r.train_inline.remote(refs[i // TP]) for i, r in enumerate(ranks)], timeout=STEP_TIMEOUT_S)
    t["train"] = time.perf_counter() - t0
    _check("train (funnel)", got, {k: want[k] for k in TRAIN_FIELDS})
    t0 = time.perf_counter()
    del data, refs
    t["clear"] = time.perf_counter() - t0
    return t, moved


def start_processes() -> tuple[Any, list[Any]]:
    """The rollout process and the ``DP x TP`` trainer ranks (joined in one gloo group)."""
    import ray

    rollout = ray.remote(RolloutProc).options(num_cpus=0.2).remote()
    ranks = [ray.remote(Rank).options(num_cpus=0.2).remote(r) for r in range(DP * TP)]
    port = ray.get(ranks[0].free_port.remote(), timeout=300)
    ray.get([r.join.remote(port) for r in ranks], timeout=300)
    return rollout, ranks


def measure_size(rollout: Any, ranks: list[Any], urls: list[str], size_mb: int, repeat: int) -> list[dict[str, Any]]:
    """Every contender at one size, one warm-up step then ``repeat`` rounds of one step each, in turns
    (the processes are connected to ``urls`` already)."""
    import ray

    from integrations.rl.metering import TrafficMeter

    meters = {u: TrafficMeter() for u in urls}
    clients = {u: meters[u].wrap(dataplane.connect(u)) for u in urls}
    try:
        sums = ray.get(rollout.build.remote(size_mb * MB), timeout=600)
        want = {k: sums[k] for k in ROLLOUT_FIELDS if k in TRAIN_FIELDS}
        want["advantages"] = checksum(advantages_of(ray.get(rollout.batch.remote(), timeout=600)["reward"]))
        want["prev_logprobs"] = -0.5 * sums["loss_mask"]  # what fake_logprobs writes, summed
        times: dict[str, list[dict[str, float]]] = {c: [] for c in [FUNNEL, *urls]}
        moved: dict[str, list[int]] = {c: [] for c in times}
        peaks: dict[str, list[int]] = {c: [] for c in times}
        for n in range(1 + repeat):
            for name in times:
                before = meters[name].totals() if name in meters else None
                with _RssPeak() as rss:
                    if name == FUNNEL:
                        t, m = step_funnel(rollout, ranks, want)
                    else:
                        t = step_dataplane(name, clients[name], rollout, ranks, want, n)
                        after = meters[name].totals()
                        assert before is not None
                        m = int(after["bytes_get"] - before["bytes_get"] + after["bytes_put"] - before["bytes_put"])
                if n:  # the first round warms up
                    times[name].append(t)
                    moved[name].append(m)
                    peaks[name].append(rss.peak - rss.base)
        steps = {c: [sum(t.values()) for t in ts] for c, ts in times.items()}
        out = []
        for name, ts in times.items():
            ratio = paired(steps[FUNNEL], steps[name])
            out.append(
                {
                    "name": name,
                    "backend": None if name == FUNNEL else name,
                    "size_bytes": size_mb * MB,
                    "rows": batch_rows(size_mb * MB),
                    "step_seconds": statistics.median(steps[name]),
                    "phases": {p: statistics.median(t[p] for t in ts) for p in PHASES},
                    "speedup_vs_funnel": ratio["median"],
                    "speedup_vs_funnel_ci95": [ratio["low"], ratio["high"]],
                    "driver_bytes": int(statistics.median(moved[name])),
                    "driver_peak_rss_delta_bytes": int(max(peaks[name])),
                    "repeat": repeat,
                }
            )
        return out
    finally:
        close_all(clients.values())


def installed(urls: list[str]) -> tuple[list[str], dict[str, str]]:
    """The URLs whose backend is installed, and why each other one is skipped."""
    ok, skipped = [], {}
    for url in urls:
        needs = (("transfer_queue", "ray") if url.startswith("tq://") else ()) + (
            ("mooncake",) if "mooncake" in url else ()
        )
        missing = [m for m in needs if importlib.util.find_spec(m) is None]  # as BenchBackend.missing
        if missing:
            extra = "tq" if url.startswith("tq://") else "mooncake"
            skipped[url] = f"needs {', '.join(missing)} (pip install 'dataplane[{extra}]')"
        else:
            ok.append(url)
    return ok, skipped


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from dataplane.local_ray import init_local_ray

    urls, skipped = installed(args.backends)
    init_local_ray(num_cpus=8, log_to_driver=False)
    machine_before = machine_info()
    # one TransferQueue per Ray: the first tq:// URL runs with the others, each further one on its own
    # (with a funnel of its own measured beside it, so that its ratio stays paired)
    tq = [u for u in urls if u.startswith("tq://")]
    rounds = [[u for u in urls if u not in tq[1:]], *([u] for u in tq[1:])]
    contenders: list[dict[str, Any]] = []
    rollout, ranks = start_processes()
    for i, group in enumerate(rounds):
        owners = [dataplane.connect(u) for u in group]  # the deployments; the contenders join them
        try:
            joined = [o.url for o in owners]
            ray.get([a.connect.remote(joined) for a in [rollout, *ranks]], timeout=300)
            for size in args.sizes:
                found = measure_size(rollout, ranks, joined, size, args.repeat)
                for c, url in zip(found[1:], group, strict=True):
                    c["name"] = c["backend"] = url  # the URL as the user writes it
                if i:  # a later round's funnel is its contender's baseline only
                    found[1]["funnel_of_its_round"] = {k: found[0][k] for k in ("step_seconds", "phases")}
                    found = found[1:]
                contenders += found
                if args.progress:
                    for c in found:
                        line = f"{size} MB  {c['name']:<24} {c['step_seconds']:.3f} s/step"
                        print(f"{line}  x{c['speedup_vs_funnel']:.2f}", file=sys.stderr)
        finally:
            try:
                ray.get([a.close.remote() for a in [rollout, *ranks]], timeout=120)
            finally:
                close_all(owners)
    for a in [rollout, *ranks]:
        ray.kill(a)
    contenders.sort(key=lambda c: (c["size_bytes"], c["name"] != FUNNEL))
    return {
        "benchmark": "rl_step",
        "config": {
            "sizes_mb": args.sizes,
            "repeat": args.repeat,
            "dp": DP,
            "tp": TP,
            "group_size": GROUP,
            "mean_len": MEAN_LEN,
            "max_len": MAX_LEN,
            "quick": args.quick,
        },
        "contenders": contenders,
        "skipped": skipped,
        "machine": machine_before,
    }


def to_markdown(report: dict[str, Any]) -> str:
    lines = report_head(
        f"One RL step's data movement: data plane against the driver funnel ({report['date']})",
        f"{machine_line(report['machine'])} Command: `{report['command']}`. Medians of "
        f"{report['config']['repeat']} steps per contender after a warm-up, contenders in turns; dp={DP} x tp={TP}.",
        ["size", "contender", "step (s)", *PHASES, "vs funnel", "driver bytes", "driver peak RSS"],
    )
    for c in report["contenders"]:
        phases = " | ".join(f"{c['phases'][p]:.3f}" for p in PHASES)
        lines.append(
            f"| {human_bytes(c['size_bytes'])} | `{c['name']}` | {c['step_seconds']:.3f} | {phases} | "
            f"{c['speedup_vs_funnel']:.2f}x | {human_bytes(c['driver_bytes'])} | {human_bytes(c['driver_peak_rss_delta_bytes'])} |"
        )
    lines += [
        "",
        "`vs funnel`: the paired median of funnel seconds over contender seconds (above 1: faster than the "
        "funnel). One TransferQueue runs per Ray, so a second `tq://` backend runs in a later round beside "
        "a funnel of its own (its `funnel_of_its_round` in the JSON), against which its ratio is taken.",
    ]
    if report.get("png"):
        lines += ["", f"![seconds per phase]({report['png']})"]
    for url, why in report.get("skipped", {}).items():
        lines.append(f"\n`{url}` skipped: {why}.")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Stacked phase seconds per contender, one panel per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({c["size_bytes"] for c in report["contenders"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        cs = [c for c in report["contenders"] if c["size_bytes"] == size]
        bottom = np.zeros(len(cs))
        for p in PHASES:
            vals = np.array([c["phases"][p] for c in cs])
            ax.bar(range(len(cs)), vals, bottom=bottom, label=p)
            bottom += vals
        ax.set_xticks(range(len(cs)), [c["name"].replace("://", "://\n") for c in cs], fontsize=7)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{human_bytes(size)} batch")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rl_step", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the smoke run: a 4 MB batch, 1 step per contender")
    p.add_argument("--sizes", default=None, help="batch sizes in MB, comma-separated (default 64,512)")
    p.add_argument("--repeat", type=int, default=None, help="steps per contender after the warm-up (default 5)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated URLs (default: every backend)")
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="the report (default benchmarks/reports/<date>_<machine>_rl_step.json)",
    )
    p.add_argument("--plot", default=None, metavar="PATH", help="the PNG (default beside the JSON)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    a.sizes = [int(x) for x in (a.sizes or ("4" if a.quick else "64,512")).split(",")]
    a.repeat = a.repeat or (1 if a.quick else 5)
    a.backends = [u for u in a.backends.split(",") if u]
    return a


def main(argv: list[str] | None = None) -> int:
    import datetime

    args = parse_args(argv)
    report = run(args)
    report["date"] = datetime.date.today().isoformat()
    report["command"] = " ".join(["python -m benchmarks.rl_step", *(sys.argv[1:] if argv is None else argv)])
    stem = Path(args.json).with_suffix("") if args.json else default_out("rl_step", report["machine"])
    png = Path(args.plot) if args.plot else stem.with_suffix(".png")
    report["png"] = png.name
    json_path = write_report(report, to_markdown(report), stem)
    plot(report, png)
    print(to_markdown(report))
    print(f"wrote {json_path}, {stem.with_suffix('.md')} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
