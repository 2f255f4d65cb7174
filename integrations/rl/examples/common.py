"""What the runnable examples share: options, the Ray actors of a run, the step loop, the command line.

``grpo_tiny`` and ``ppo_tiny`` are this runner with an algorithm; see their docstrings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import dataplane
from dataplane import DataPlaneClient, InvalidArgument
from integrations.rl.grpo import GRPO, GRPOConfig
from integrations.rl.policy import Policy, gather
from integrations.rl.ppo import PPO, PPOConfig
from integrations.rl.rollout import CountingTask
from integrations.rl.rollout_actor import RolloutActor
from integrations.rl.sync_loop import StepRecord, SyncLoop
from integrations.rl.workers.model import TinyConfig
from integrations.rl.workers.tiny import TinyDTensorWorker

__all__ = ["Cluster", "Options", "main", "parse_args", "run"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """One run's settings (the command line's flags)."""

    algorithm: Literal["grpo", "ppo"] = "grpo"
    steps: int = 20
    backend: str = "mooncake://local"
    transport: Literal["dataplane", "inline"] = "dataplane"
    train_step: Literal["split", "monolithic"] = "split"
    seed: int = 0
    dp: int = 2
    tp: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 6
    vocab_size: int = 8
    target_len: int = 4
    lr: float = 1e-2
    kl_coef: float = 0.01
    value_lr: float = 1e-2
    value_shift: bool = True
    max_tokens_per_microbatch: int = 128
    json: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.algorithm not in ("grpo", "ppo"):
            raise InvalidArgument(f"algorithm must be 'grpo' or 'ppo', got {self.algorithm!r}")
        if self.transport not in ("dataplane", "inline"):
            raise InvalidArgument(f"--transport must be 'dataplane' or 'inline', got {self.transport!r}")
        for name in ("steps", "dp", "tp", "prompts_per_step", "group_size", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")

    def model(self) -> TinyConfig:
        return TinyConfig(vocab_size=self.vocab_size, dim=32, n_layers=2, n_heads=4, max_len=32)

    def task(self) -> CountingTask:
        return CountingTask(vocab_size=self.vocab_size, prompt_len=4, target_len=self.target_len)

    def factories(self) -> dict[str, Callable[[], TinyDTensorWorker]]:
        """The trainer ranks' models: the policy, a frozen reference from the same seed when there is
        a KL penalty, and for PPO a value model (``head="value"``)."""
        policy = functools.partial(TinyDTensorWorker, self.model(), tp=self.tp, lr=self.lr, seed=self.seed)
        out: dict[str, Callable[[], TinyDTensorWorker]] = {"policy": policy}
        if self.kl_coef > 0:
            out["reference"] = policy
        if self.algorithm == "ppo":
            value = replace(self.model(), head="value")
            out["value"] = functools.partial(
                TinyDTensorWorker, value, tp=self.tp, lr=self.value_lr, seed=self.seed + 1, value_shift=self.value_shift
            )
        return out

    def loop(self, policy: Policy, rollout: Any, client: DataPlaneClient | None) -> SyncLoop:
        """The algorithm over these actors."""
        if self.algorithm == "ppo":
            return PPO(
                policy,
                rollout,
                PPOConfig(kl_coef=self.kl_coef, train_step=self.train_step, seed=self.seed),
                client=client,
            )
        return GRPO(policy, rollout, GRPOConfig(kl_coef=self.kl_coef, train_step=self.train_step), client=client)


class Cluster:
    """The Ray actors of a run: a trainer group and a rollout actor. A test reuses one for several
    runs of the same shapes (:meth:`reset` rebuilds the models from the run's seed)."""

    def __init__(self, policy: Policy, rollout: Any, opts: Options) -> None:
        self.policy, self.rollout, self.opts = policy, rollout, opts

    @classmethod
    def start(cls, opts: Options) -> Cluster:
        """Spawn ``dp * tp`` trainer actors and a rollout actor (Ray must be running), each with an
        equal share of Ray's free CPUs up to half a CPU (a Ray that ``tq://`` started keeps two for
        TransferQueue)."""
        import ray

        actors = opts.dp * opts.tp + 1
        free = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]
        share = min(0.5, int(100 * free / actors) / 100)
        if share < 0.01:
            raise InvalidArgument(f"Ray has {free:g} free CPUs for {actors} actors; start Ray with more num_cpus")
        policy = Policy.spawn(
            opts.factories(),
            dp=opts.dp,
            tp=opts.tp,
            num_cpus=share,
            max_tokens_per_microbatch=opts.max_tokens_per_microbatch,
        )
        rollout = (
            ray.remote(RolloutActor)
            .options(num_cpus=share)
            .remote(
                opts.model(),
                opts.task(),
                prompts_per_step=opts.prompts_per_step,
                group_size=opts.group_size,
                max_new_tokens=opts.max_new_tokens,
                seed=opts.seed,
            )
        )
        return cls(policy, rollout, opts)

    def reset(self, opts: Options, url: str | None) -> None:
        """Fresh models from ``opts.seed``, the rollout's seed, and the data plane at ``url`` (or none)."""
        same: tuple[str, ...] = ("dp", "tp", "prompts_per_step", "group_size", "max_new_tokens", "vocab_size")
        same += ("target_len", "max_tokens_per_microbatch")
        if any(getattr(opts, k) != getattr(self.opts, k) for k in same):
            raise InvalidArgument(f"a cluster runs one shape; start another for different {same}")
        self.policy.build(opts.factories())
        self.policy.connect(url)
        gather(
            [self.rollout.reset.remote(opts.seed), self.rollout.connect.remote(url)],
            timeout_s=60,
            what="rollout reset",
            names=["rollout", "rollout"],
        )
        self.opts = opts

    def shutdown(self) -> None:
        import ray

        self.policy.shutdown()
        ray.kill(self.rollout, no_restart=True)


def _machine() -> dict[str, Any]:
    import torch

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _value_digest(policy: Policy, opts: Options) -> dict[str, Any]:
    if opts.algorithm != "ppo":
        return {}
    digest = policy.param_digest("value")
    return {"value_param_sha256": digest.sha256, "value_param_norm": digest.norm}


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def _line(s: dict[str, Any], total: int) -> str:
    def num(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    if "value_loss" in s:  # PPO
        middle = f"value loss {num(s['value_loss'], '.4f')}  explained var {num(s['explained_variance'], '+.3f')}"
    else:
        middle = f"dropped {s['dropped_groups']}/{s['groups']}"
    return (
        f"step {s['step'] + 1:>3}/{total}  reward {s['reward_mean']:.3f}  kl {num(s['kl'], '.4f')}  "
        f"loss {num(s['loss'], '+.4f')}  {middle}  {s['seconds']:.2f} s (data plane {s['data_plane_seconds']:.3f} s)"
    )


def run(
    opts: Options,
    *,
    cluster: Cluster | None = None,
    client: DataPlaneClient | None = None,
    on_step: Callable[[StepRecord, SyncLoop], None] | None = None,
    out: Any = None,
) -> dict[str, Any]:
    """Run ``opts.steps`` GRPO steps and return the run's JSON document (also written to ``opts.json``).

    Args:
        opts: the settings.
        cluster: actors to reuse (reset to ``opts.seed``); default: start them, and stop them at the end.
        client: the driver's client of ``opts.backend`` (default: connect, and close at the end).
        on_step: called after each step with its record and the trainer (tests look at the store here).
        out: where step lines go (default stdout; the progress bar goes to stderr when it is a terminal).
    """
    import ray

    from dataplane.local_ray import init_local_ray

    out = out or sys.stdout
    t_start = time.perf_counter()
    own_client = client is None and opts.transport == "dataplane"
    if own_client:
        client = dataplane.connect(opts.backend)
    if client is not None and opts.transport == "inline":
        raise InvalidArgument("--transport inline uses no data plane; pass no client")
    own_cluster = cluster is None
    try:
        if client is not None and not client.capabilities.cross_process:
            raise InvalidArgument(
                f"{opts.backend} keeps rows inside one process, but the rollout and trainer actors are processes "
                "of their own: use --backend mooncake://local, tq://?backend=simple or tq://?backend=mooncake"
            )
        init_local_ray(num_cpus=max(4, opts.dp * opts.tp + 2), log_to_driver=False)  # a no-op when tq:// started Ray
        url = None if client is None else client.url
        if cluster is None:
            cluster = Cluster.start(opts)
            cluster.policy.connect(url)
            gather([cluster.rollout.connect.remote(url)], timeout_s=60, what="rollout connect", names=["rollout"])
        else:
            cluster.reset(opts, url)
        loop = opts.loop(cluster.policy, cluster.rollout, client)
        loop.sync_weights()
        t_ready = time.perf_counter()
        steps: list[dict[str, Any]] = []
        tty = opts.progress and sys.stderr.isatty()
        for step in range(opts.steps):
            record = loop.step(step)
            if on_step is not None:
                on_step(record, loop)
            steps.append(record.summary())
            if opts.progress:
                if tty:
                    sys.stderr.write("\r\033[K")
                print(_line(steps[-1], opts.steps), file=out, flush=True)
                if tty:
                    sys.stderr.write(_bar(step + 1, opts.steps))
                    sys.stderr.flush()
        if tty:
            sys.stderr.write("\r\033[K")
        digest = cluster.policy.param_digest()
        totals = loop.traffic()
        driver = loop.meter.totals()
        doc = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "algorithm": opts.algorithm,
            "backend": opts.backend if opts.transport == "dataplane" else None,
            "transport": opts.transport,
            "train_step": opts.train_step,
            "options": {k: v for k, v in asdict(opts).items() if k not in ("json", "progress")},
            "steps": steps,
            "param_sha256": digest.sha256,
            "param_norm": digest.norm,
            **_value_digest(cluster.policy, opts),
            "bytes_put": totals["bytes_put"],
            "bytes_get": totals["bytes_get"],
            "driver_bytes_get": driver["bytes_get"],
            "driver_bytes_put": driver["bytes_put"],
            "data_plane_seconds": totals["seconds"],
            "startup_seconds": t_ready - t_start,
            "total_seconds": time.perf_counter() - t_start,
            "machine": _machine(),
            "ray_node": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        }
    finally:
        if own_cluster and cluster is not None:
            cluster.shutdown()
        if own_client and client is not None:
            client.close()
    if opts.json:
        Path(opts.json).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def parse_args(argv: Sequence[str] | None = None, *, defaults: Options, module: str, doc: str) -> Options:
    """The example's command line over ``defaults`` (its algorithm's settings)."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="GRPO steps (default 20)")
    p.add_argument("--backend", default="mooncake://local", help="data plane URL (default mooncake://local)")
    p.add_argument("--transport", choices=["dataplane", "inline"], default="dataplane")
    p.add_argument("--train-step", choices=["split", "monolithic"], default="split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, default=2, help="data-parallel trainer ranks (default 2)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--kl-coef", type=float, default=defaults.kl_coef)
    if defaults.algorithm == "ppo":
        p.add_argument("--value-lr", type=float, default=defaults.value_lr)
        p.add_argument(
            "--no-value-shift",
            action="store_true",
            help="ablation: keep the value head's output at t where it is (one token late) instead of shifting it right",
        )
    p.add_argument("--json", metavar="PATH", help="write the run here")
    a = p.parse_args(argv)
    ppo = defaults.algorithm == "ppo"
    return replace(
        defaults,
        value_lr=a.value_lr if ppo else defaults.value_lr,
        value_shift=not a.no_value_shift if ppo else True,
        steps=a.steps,
        backend=a.backend,
        transport=a.transport,
        train_step=a.train_step,
        seed=a.seed,
        dp=a.dp,
        tp=a.tp,
        lr=a.lr,
        kl_coef=a.kl_coef,
        json=a.json,
    )


def main(argv: Sequence[str] | None, *, defaults: Options, module: str, doc: str) -> int:
    """Run the example from the command line; 2 on bad arguments."""
    try:
        opts = parse_args(argv, defaults=defaults, module=module, doc=doc)
        result = run(opts)
    except InvalidArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first, last3 = result["steps"][0]["reward_mean"], result["steps"][-3:]
    tail = sum(s["reward_mean"] for s in last3) / len(last3)
    if opts.transport == "inline":
        moved = "no data plane: the tensors went through the driver"
    else:
        share = result["driver_bytes_get"] / result["bytes_get"] if result["bytes_get"] else 0.0
        moved = f"the driver read {result['driver_bytes_get']} of the {result['bytes_get']} bytes read ({share:.2%})"
    print(
        f"reward {first:.3f} -> {tail:.3f} (mean of the last {len(last3)} steps) in {result['total_seconds']:.1f} s; "
        f"params sha256 {result['param_sha256'][:16]}..., norm {result['param_norm']:.6f}; {moved}"
    )
    if opts.json:
        print(f"wrote {opts.json}")
    return 0
