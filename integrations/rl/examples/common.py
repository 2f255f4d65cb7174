"""What the runnable examples share: options, the Ray actors of a run, the step loop, the command line.

``grpo_tiny``, ``ppo_tiny`` and ``grpo_async_tiny`` are this runner with an algorithm; see their docstrings.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import dataplane
from dataplane import DataPlaneClient, InvalidArgument
from dataplane.checks import check_int, check_number
from integrations.rl.checkpoint import RunCheckpoints
from integrations.rl.controller import AsyncConfig, AsyncGRPO
from integrations.rl.examples import models
from integrations.rl.examples.progress import Progress
from integrations.rl.grpo import GRPO, GRPOConfig
from integrations.rl.metering import add_totals
from integrations.rl.policy import ActorFailure, Policy, gather
from integrations.rl.ppo import PPO, PPOConfig
from integrations.rl.rollout_actor import RolloutActor
from integrations.rl.sync_loop import StepRecord, SyncLoop
from integrations.rl.tasks import Task

__all__ = ["Cluster", "Options", "run", "start_ray"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """One run's settings (the command line's flags)."""

    algorithm: Literal["grpo", "ppo", "grpo_async"] = "grpo"
    model: Literal["tiny", "qwen2", "llama"] = "tiny"
    steps: int = 20
    backend: str = "mooncake://local"
    transport: Literal["dataplane", "inline"] = "dataplane"
    train_step: Literal["split", "monolithic"] = "split"
    seed: int = 0
    dp: int = 2
    tp: int = 1
    pp: int = 1  # pipeline stages (--worker megatron only)
    worker: Literal["fsdp2", "megatron"] = "fsdp2"
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 6
    vocab_size: int = 8
    target_len: int = 4
    lr: float | None = None  # None: the model's (models.default_lr)
    kl_coef: float = 0.01
    value_lr: float = 1e-2
    value_shift: bool = True
    max_tokens_per_microbatch: int = 128
    max_staleness: int = 1
    capacity: int | None = None
    in_order: bool = False
    rollout_actors: int = 1
    rollout_latency: float = 0.0
    device: Literal["cpu", "cuda"] = "cpu"
    task_name: str = "counting"  # models.TASKS or a GSM8K-format JSONL file
    engine: Literal["torch", "hf"] = "torch"
    tokenizer: str | None = None
    max_operand: int = 9
    temperature: float = 1.0
    eval_every: int = 0
    eval_prompts: int = 64
    checkpoint_dir: str | None = None
    checkpoint_every: int = 5
    keep: int = 2
    resume: bool = False
    max_restarts: int = 0
    log_dir: str | None = None
    tensorboard: str | None = None
    json: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.algorithm not in ("grpo", "ppo", "grpo_async"):
            raise InvalidArgument(f"algorithm must be 'grpo', 'ppo' or 'grpo_async', got {self.algorithm!r}")
        if self.algorithm == "grpo_async":
            if self.transport != "dataplane":
                raise InvalidArgument(
                    "asynchronous GRPO moves rows through the data plane only; drop --transport inline"
                )
            self.async_config()  # validates --max-staleness and --capacity
        if self.model not in models.MODELS:
            raise InvalidArgument(f"--model must be one of {models.MODELS}, got {self.model!r}")
        if self.lr is None:
            object.__setattr__(self, "lr", models.default_lr(self.model))
        if self.transport not in ("dataplane", "inline"):
            raise InvalidArgument(f"--transport must be 'dataplane' or 'inline', got {self.transport!r}")
        check_number("--rollout-latency", self.rollout_latency, low=0, high=3600, high_open=True)
        check_int("--checkpoint-every", self.checkpoint_every, low=1)
        check_int("--keep", self.keep, low=1)
        check_int("--max-restarts", self.max_restarts, low=0)
        if self.max_restarts and self.algorithm == "grpo_async":
            raise InvalidArgument("asynchronous GRPO does not restart its actors yet; drop --max-restarts")
        if self.resume and not self.checkpoint_dir:
            raise InvalidArgument("--resume needs --checkpoint-dir (the directory a run saved into)")
        if self.engine not in ("torch", "hf"):
            raise InvalidArgument(f"--engine must be 'torch' or 'hf', got {self.engine!r}")
        if self.task_name not in models.TASKS and not os.path.isfile(self.task_name):
            raise InvalidArgument(
                f"--task must be one of {models.TASKS} or a GSM8K-format JSONL file, got {self.task_name!r}"
            )
        check_int("--eval-every", self.eval_every, low=0)
        check_int("--eval-prompts", self.eval_prompts, low=1)
        if self.eval_every and self.algorithm == "grpo_async":
            raise InvalidArgument("asynchronous GRPO does not run evaluations yet; drop --eval-every")
        for name in ("steps", "dp", "tp", "pp", "prompts_per_step", "group_size", "max_new_tokens", "rollout_actors"):
            check_int(name, getattr(self, name), low=1)
        if self.device not in ("cpu", "cuda"):
            raise InvalidArgument(f"--device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda":
            import torch

            have, need = torch.cuda.device_count(), self.ranks
            if have < need:
                raise InvalidArgument(
                    f"--device cuda puts each of the dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = {need} trainer "
                    f"ranks on a GPU of its own, but torch sees {have} CUDA device(s) here "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): lower --dp/--tp/--pp so that "
                    f"dp x tp x pp <= {have}, run on a host with {need} GPUs, or use --device cpu"
                )
        self._check_worker()

    @property
    def ranks(self) -> int:
        """Trainer ranks: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    def _check_worker(self) -> None:
        """``--worker``: FSDP2 anywhere; Megatron on CUDA with megatron-core, the tiny model, no checkpoints."""
        if self.worker not in ("fsdp2", "megatron"):
            raise InvalidArgument(f"--worker must be 'fsdp2' or 'megatron', got {self.worker!r}")
        if self.worker == "fsdp2":
            if self.pp != 1:
                raise InvalidArgument(f"--pp {self.pp} needs --worker megatron (FSDP2 workers have no pipeline stages)")
            return
        if self.device != "cuda":
            raise InvalidArgument("--worker megatron trains with Megatron-Core, on GPUs only: add --device cuda")
        from integrations.rl.workers.megatron import require_megatron

        require_megatron()  # megatron-core importable, a CUDA device seen
        if self.model != "tiny":
            raise InvalidArgument(
                f"--worker megatron trains the tiny model as a Megatron GPT; --model {self.model} trains with "
                "--worker fsdp2 (an HF model on Megatron needs its weights converted: docs/rl/megatron.md)"
            )
        if self.checkpoint_dir:
            raise InvalidArgument(
                "--worker megatron does not checkpoint yet (its state needs Megatron's dist_checkpointing); "
                "drop --checkpoint-dir, or use --worker fsdp2"
            )

    def rollout_model(self, task: Any = None) -> Any:
        """What the rollout actor samples with (see :mod:`integrations.rl.examples.models`)."""
        return models.rollout_model(self, task)

    def task(self) -> Task:
        """The run's task (``--task``; see :func:`integrations.rl.examples.models.build_task`)."""
        return models.build_task(self)  # type: ignore[no-any-return]

    def factories(self) -> dict[str, Callable[[], Any]]:
        """The trainer ranks' workers (see :func:`integrations.rl.examples.models.worker_factories`)."""
        return models.worker_factories(self)

    def trainer_resources(self) -> dict[str, Any]:
        """What :meth:`Policy.spawn <integrations.rl.policy.Policy.spawn>` takes besides the defaults for
        ``device``: on CUDA a GPU per trainer actor, NCCL, and deterministic kernels (so a run through
        the data plane and one without end with the same bits, as on a CPU); nothing on the CPU."""
        if self.device == "cpu":
            return {}
        return {"num_gpus": 1, "backend": "nccl", "deterministic": True}

    def ray_resources(self) -> dict[str, Any]:
        """``ray.init`` arguments beside ``num_cpus`` (:func:`start_ray`): on CUDA, every GPU torch sees."""
        if self.device == "cpu":
            return {}
        import torch

        return {"num_gpus": torch.cuda.device_count()}

    def grpo_config(self) -> GRPOConfig:
        return GRPOConfig(kl_coef=self.kl_coef, train_step=self.train_step)

    def async_config(self) -> AsyncConfig:
        """The asynchronous run's settings (``algorithm="grpo_async"``)."""
        return AsyncConfig(
            grpo=self.grpo_config(),
            groups_per_step=self.prompts_per_step,
            group_size=self.group_size,
            max_staleness=self.max_staleness,
            ordered=self.in_order,
            capacity=self.capacity,
        )

    def loop(self, policy: Policy, rollout: Any, client: DataPlaneClient | None) -> SyncLoop:
        """The algorithm over these actors."""
        if self.algorithm == "ppo":
            return PPO(
                policy,
                rollout,
                PPOConfig(kl_coef=self.kl_coef, train_step=self.train_step, seed=self.seed),
                client=client,
            )
        return GRPO(policy, rollout, self.grpo_config(), client=client)


class Cluster:
    """The Ray actors of a run: a trainer group and ``opts.rollout_actors`` rollout actors. A test
    reuses one for several runs of the same shapes (:meth:`reset` rebuilds the models from the run's
    seed)."""

    def __init__(self, policy: Policy, rollouts: Sequence[Any], opts: Options) -> None:
        self.policy, self.rollouts, self.opts = policy, list(rollouts), opts

    @property
    def rollout(self) -> Any:
        """The first rollout actor (the synchronous algorithms use one)."""
        return self.rollouts[0]

    @classmethod
    def start(cls, opts: Options) -> Cluster:
        """Spawn ``dp * tp * pp`` trainer actors and a rollout actor (Ray must be running), each with an
        equal share of Ray's free CPUs up to half a CPU (a Ray that ``tq://`` started keeps two for
        TransferQueue)."""
        import ray

        actors = opts.ranks + opts.rollout_actors
        free = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]
        share = min(0.5, int(100 * free / actors) / 100)
        if share < 0.01:
            raise InvalidArgument(f"Ray has {free:g} free CPUs for {actors} actors; start Ray with more num_cpus")
        if opts.device == "cuda":
            gpus = float(ray.available_resources().get("GPU", 0.0))  # type: ignore[no-untyped-call]
            if gpus < opts.ranks:
                raise InvalidArgument(
                    f"Ray has {gpus:g} free GPUs for {opts.ranks} trainer ranks on --device cuda; start Ray "
                    "with num_gpus (start_ray does), or free its GPUs"
                )
        policy = Policy.spawn(
            opts.factories(),
            dp=opts.dp,
            tp=opts.tp,
            pp=opts.pp,
            num_cpus=share,
            max_tokens_per_microbatch=opts.max_tokens_per_microbatch,
            **opts.trainer_resources(),
        )
        task = opts.task()
        rollouts = [
            ray.remote(RolloutActor)
            .options(num_cpus=share)
            .remote(
                opts.rollout_model(task),
                task,
                prompts_per_step=opts.prompts_per_step,
                group_size=opts.group_size,
                max_new_tokens=opts.max_new_tokens,
                temperature=opts.temperature,
                seed=opts.seed,
                latency_s=opts.rollout_latency,
            )
            for _ in range(opts.rollout_actors)
        ]
        return cls(policy, rollouts, opts)

    def connect(self, url: str | None) -> None:
        """Point the trainers and every rollout actor at the data plane ``url`` (or at none)."""
        self.policy.connect(url)
        gather(
            [a.connect.remote(url) for a in self.rollouts],
            timeout_s=60,
            what="rollout connect",
            names=[f"rollout {i}" for i in range(len(self.rollouts))],
        )

    def reset(self, opts: Options, url: str | None) -> None:
        """Fresh models from ``opts.seed``, the rollout's seed, and the data plane at ``url`` (or none)."""
        same: tuple[str, ...] = ("model", "dp", "tp", "prompts_per_step", "group_size", "max_new_tokens", "vocab_size")
        same += (
            "target_len",
            "max_tokens_per_microbatch",
            "rollout_actors",
            "rollout_latency",
            "device",
            "worker",
            "pp",
        )
        same += ("task_name", "engine", "tokenizer", "max_operand", "temperature", "eval_prompts")
        if any(getattr(opts, k) != getattr(self.opts, k) for k in same):
            raise InvalidArgument(f"a cluster runs one shape; start another for different {same}")
        self.policy.build(opts.factories())
        gather(
            [a.reset.remote(opts.seed) for a in self.rollouts],
            timeout_s=60,
            what="rollout reset",
            names=[f"rollout {i}" for i in range(len(self.rollouts))],
        )
        self.connect(url)
        self.opts = opts

    def shutdown(self) -> None:
        import ray

        self.policy.shutdown()
        for actor in self.rollouts:
            ray.kill(actor, no_restart=True)

    def restart(self, url: str | None) -> None:
        """Replace every actor (a trainer group that lost a rank cannot go on) with fresh ones of the
        same shape, joined to ``url``; their models start from the seed until a checkpoint is loaded."""
        self.shutdown()
        fresh = Cluster.start(self.opts)
        self.policy, self.rollouts = fresh.policy, fresh.rollouts
        self.connect(url)


def start_ray(opts: Options) -> bool:
    """The run's local Ray (:func:`dataplane.local_ray.init_local_ray`): CPUs for every actor, and on
    ``--device cuda`` every GPU torch sees. A no-op when this process runs Ray already (``tq://``
    started it); returns whether this call started it."""
    from dataplane.local_ray import init_local_ray

    return init_local_ray(num_cpus=max(4, opts.ranks + 2), log_to_driver=False, **opts.ray_resources())


def _machine() -> dict[str, Any]:
    import torch

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _step_times(steps: list[dict[str, Any]]) -> dict[str, float]:
    """The run's trainer times per rank: the steps' ``trainer_data_seconds`` and ``trainer_compute_seconds`` summed."""
    return {k: sum(s[k] for s in steps) for k in ("trainer_data_seconds", "trainer_compute_seconds")}


def _value_digest(policy: Policy, opts: Options) -> dict[str, Any]:
    if opts.algorithm != "ppo":
        return {}
    digest = policy.param_digest("value")
    return {"value_param_sha256": digest.sha256, "value_param_norm": digest.norm}


def _run_async(
    opts: Options,
    cluster: Cluster,
    url: str,
    on_step: Callable[[Any, Any], None] | None,
    progress: Progress,
    out: Any,
) -> tuple[float, list[dict[str, Any]], dict[str, Any]]:
    """The asynchronous run: a controller actor (:class:`~integrations.rl.controller.AsyncGRPO`) over
    the cluster's actors; this driver only asks it for one step at a time, a checkpoint every
    ``--checkpoint-every`` steps (:meth:`~integrations.rl.controller.AsyncGRPO.checkpoint`), and with
    ``--resume`` to go on from the latest one first."""
    import ray

    timeout = 2 * opts.grpo_config().timeout_s + 60
    controller = (
        ray.remote(AsyncGRPO).options(num_cpus=0).remote(cluster.policy, cluster.rollouts, opts.async_config(), url=url)
    )

    def call(method: str, *args: Any, **kw: Any) -> Any:
        ref = getattr(controller, method).remote(*args, **kw)
        return gather([ref], timeout_s=timeout, what=method, names=["controller"])[0]

    steps: list[dict[str, Any]] = []
    stats: dict[str, Any] = {}
    saved: list[dict[str, Any]] = []  # each checkpoint's step, seconds, bytes and buffered groups
    try:
        if opts.resume:
            assert opts.checkpoint_dir is not None
            steps = list(call("resume", opts.checkpoint_dir)["steps"])
            where = RunCheckpoints(opts.checkpoint_dir).latest()
            print(f"resumed from {where} after step {len(steps)}", file=out, flush=True)
        call("start")
        t_ready = time.perf_counter()
        for step in range(len(steps), opts.steps):
            record = call("step")
            if on_step is not None:
                on_step(record, controller)
            steps.append(record.summary())
            progress.step(steps[-1])
            if opts.checkpoint_dir and ((step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps):
                driver = {"steps": steps, "options": asdict(opts)}
                saved.append(call("checkpoint", opts.checkpoint_dir, keep=opts.keep, driver=driver))
    finally:
        try:
            stats = call("stop")
        finally:
            ray.kill(controller, no_restart=True)
    rollouts = []
    for i, actor in enumerate(cluster.rollouts):
        if f"rollout {i}" not in stats["lost_actors"]:
            rollouts += gather([actor.traffic.remote()], timeout_s=60, what="traffic", names=[f"rollout {i}"])
    mine = stats.pop("traffic")
    extra = {
        "max_trained_staleness": stats["max_trained_staleness"],
        "controller": stats,
        "traffic": add_totals(mine, *cluster.policy.traffic(), *rollouts),
        "controller_traffic": mine,
        **({"checkpoints": saved} if opts.checkpoint_dir else {}),
    }
    return t_ready, steps, extra


def evaluate(cluster: Cluster, opts: Options) -> dict[str, float]:
    """Greedy decoding of ``opts.eval_prompts`` held-out prompts by the rollout actor with its current
    weights (:meth:`~integrations.rl.rollout_actor.RolloutActor.evaluate`)."""
    ref = cluster.rollout.evaluate.remote(opts.eval_prompts)
    return gather([ref], timeout_s=300, what="evaluate", names=["rollout"])[0]  # type: ignore[no-any-return]


def _run_sync(
    opts: Options, cluster: Cluster, client: DataPlaneClient | None, on_step: Any, progress: Progress, out: Any
) -> tuple[float, list[dict[str, Any]], dict[str, Any], SyncLoop]:
    """The synchronous steps, with checkpoints (``--checkpoint-dir``), ``--resume`` and up to
    ``--max-restarts`` restarts of the actors after one died: from the latest checkpoint (or from the
    start without one), the failed step's rows already cleared by the loop."""
    ckpt = None if opts.checkpoint_dir is None else RunCheckpoints(opts.checkpoint_dir, keep=opts.keep)
    steps: list[dict[str, Any]] = []
    if ckpt is not None and opts.resume:  # the trainers' state, then the steps run so far
        steps = list(ckpt.load(cluster.policy)["steps"])
        print(f"resumed from {ckpt.latest()} after step {len(steps)}", file=out, flush=True)
    restarts: list[dict[str, Any]] = []
    saved: list[dict[str, Any]] = []  # each checkpoint's step, seconds and bytes
    t_ready = time.perf_counter()
    first_eval: dict[str, Any] = {}
    while True:
        loop = opts.loop(cluster.policy, cluster.rollout, client)
        try:
            loop.sync_weights()
            if opts.eval_every and not steps and not first_eval:  # the start of the curve
                first_eval = evaluate(cluster, opts)
                print(f"held-out accuracy before training {first_eval['eval_accuracy']:.3f}", file=out, flush=True)
            for step in range(len(steps), opts.steps):
                record = loop.step(step)
                if on_step is not None:
                    on_step(record, loop)
                steps.append(record.summary())
                if opts.eval_every and ((step + 1) % opts.eval_every == 0 or step + 1 == opts.steps):
                    steps[-1].update(evaluate(cluster, opts))
                progress.step(steps[-1])
                if ckpt is not None and ((step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps):
                    t0 = time.perf_counter()
                    path = ckpt.save(step, cluster.policy, {"steps": steps, "options": asdict(opts)})
                    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                    saved.append({"step": step, "seconds": time.perf_counter() - t0, "bytes": size})
            extra: dict[str, Any] = {"checkpoints": saved} if ckpt is not None else {}
            if first_eval:
                extra["eval_initial"] = first_eval
            return t_ready, steps, {**extra, "restarts": restarts} if restarts else extra, loop
        except ActorFailure as e:
            if len(restarts) >= opts.max_restarts:
                raise
            failed = len(steps)
            cluster.restart(None if client is None else client.url)
            latest = None if ckpt is None else ckpt.latest()
            steps = [] if ckpt is None or latest is None else list(ckpt.load(cluster.policy)["steps"])
            restarts.append({"failed_step": failed, "resumed_after_step": len(steps), "error": str(e)[:500]})
            print(
                f"restart {len(restarts)}/{opts.max_restarts}: step {failed + 1} failed ({type(e).__name__}); "
                f"the actors were replaced and steps {len(steps) + 1}..{failed + 1} are redone "
                f"from {latest or 'the start'}",
                file=out,
                flush=True,
            )


def run(
    opts: Options,
    *,
    cluster: Cluster | None = None,
    client: DataPlaneClient | None = None,
    on_step: Callable[[StepRecord, SyncLoop], None] | None = None,
    out: Any = None,
) -> dict[str, Any]:
    """Run ``opts.steps`` steps of ``opts.algorithm`` and return the run's JSON document (also written
    to ``opts.json``).

    Args:
        opts: the settings.
        cluster: actors to reuse (reset to ``opts.seed``); default: start them, and stop them at the end.
        client: the driver's client of ``opts.backend`` (default: connect, and close at the end).
        on_step: called after each step with its record and the loop (the ``SyncLoop``; for
            ``grpo_async``, the controller actor's handle): tests look at the store here.
        out: where step lines go (default stdout; the progress bar goes to stderr when it is a terminal).
    """
    import ray

    out = out or sys.stdout
    t_start = time.perf_counter()
    own_client = client is None and opts.transport == "dataplane"
    if own_client:
        client = dataplane.connect(opts.backend)
    if client is not None and opts.transport == "inline":
        raise InvalidArgument("--transport inline uses no data plane; pass no client")
    own_cluster = cluster is None
    progress: Progress | None = None
    try:
        if client is not None and not client.capabilities.cross_process:
            raise InvalidArgument(
                f"{opts.backend} keeps rows inside one process, but the rollout and trainer actors are processes "
                "of their own: use --backend mooncake://local, tq://?backend=simple or tq://?backend=mooncake"
            )
        start_ray(opts)  # a no-op when tq:// started Ray
        url = None if client is None else client.url
        if cluster is None:
            cluster = Cluster.start(opts)
            cluster.connect(url)
        else:
            cluster.reset(opts, url)
        progress = Progress(opts, out)
        if opts.algorithm == "grpo_async":
            assert url is not None
            t_ready, steps, extra = _run_async(opts, cluster, url, on_step, progress, out)
            totals, driver = extra.pop("traffic"), extra.pop("controller_traffic")
        else:
            t_ready, steps, extra, loop = _run_sync(opts, cluster, client, on_step, progress, out)
            totals, driver = loop.traffic(), loop.meter.totals()
        progress.done()
        digest = cluster.policy.param_digest()
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
            **_step_times(steps),
            "startup_seconds": t_ready - t_start,
            "total_seconds": time.perf_counter() - t_start,
            "machine": _machine(),
            "device": opts.device,
            "trainers": cluster.policy.describe(),
            "ray_node": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            **extra,
        }
    finally:
        if progress is not None:
            progress.close()  # the step logs, also when the run failed
        if own_cluster and cluster is not None:
            cluster.shutdown()
        if own_client and client is not None:
            client.close()
    if opts.json:
        Path(opts.json).write_text(json.dumps(doc, indent=1) + "\n")
    return doc
