"""verl 0.9.1's own TransferQueue calls, end to end, in one process of its own; run by ``test_verl_on_facade.py``.

    python verl_steps.py BACKEND OUT.json

``BACKEND`` is ``transferqueue`` (the real TransferQueue 0.1.11, ``tq.init()`` on a local Ray) or a
dataplane URL for the facade (``integrations.verl.install(URL)`` first, as a verl driver would).

What runs is verl's code, unmodified; only what needs a model or an LLM server is stubbed:

1. **prompts** -- ``PPOTrainer._submit_batch_to_rollout`` (sync mode): a tag-only put per prompt;
2. **rollout from a Ray actor** -- an actor that attaches with ``tq.init()`` (as
   ``AgentLoopWorkerTQ.__init__`` does) runs ``AgentLoopWorkerTQ.generate_sequences`` on verl's
   class body: status flips with ``async_kv_put``, one dense ``[1, L]`` put per session
   (``_agent_loop_postprocess``); only ``_run_agent_loop`` (the LLM call) is replaced, and its
   sessions finish in order so that the put order is fixed;
3. **one GRPO step** -- ``PPOTrainer._step_once`` on a trainer built without its ``__init__``:
   ``ReplayBuffer.sample`` (``kv_list()`` polling, prompt clears), ``_balance_batch``
   (``upsample_batch_to_divisible_size``: a get without ``select_fields`` and a dense padding put,
   then ``KVBatchMeta.reorder``), ``_compute_old_log_prob`` through verl's worker dispatch
   (``BatchData.chunk`` -> ``tqbridge`` -> ``BatchData.concat``: ``get_client()``'s
   ``async_kv_retrieve_meta``, ``async_get_data``, ``async_put``, ``async_kv_retrieve_keys``) with a
   stub worker, ``_compute_ref_log_prob``, ``_compute_advantage`` (whose get names fields nobody
   wrote), ``_update_actor``; then ``_compute_metrics`` and the step's ``kv_clear``.

Everything observable is written to OUT.json: listings, the sampled and padded metas, the metas the
puts returned, every field of every row read back, the step's metrics, and seconds per phase.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import time
import types
from typing import Any

N_PROMPTS, N_SESSIONS, DP = 3, 2, 2
FIELDS = [
    "advantages",
    "entropy",
    "input_ids",
    "old_log_probs",
    "prompts",
    "ref_log_prob",
    "response_mask",
    "responses",
    "returns",
    "rm_scores",
    "uid",
]


def _plain(x: Any) -> Any:
    """JSON-able, with the random uid of padding rows made comparable (``pad<hex>...`` -> ``pad*...``)."""
    import numpy as np
    import torch

    if isinstance(x, str) and re.match(r"pad[0-9a-f]{32}", x):
        return "pad*" + x[35:]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, dict):
        return {_plain(str(k)): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _plain(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        return _plain(x.item())
    return x


def _read(tq: Any, keys: list[str], partition_id: str) -> dict[str, Any]:
    """Every row's fields, read back one row at a time (each row's own field set)."""
    out = {}
    for k in keys:
        td = tq.kv_batch_get(keys=[k], partition_id=partition_id)
        row = {}
        for f in td.keys():
            v = td.get(f)
            if hasattr(v, "is_nested") and v.is_nested:
                row[f] = {"nested": [r.tolist() for r in v.unbind()]}
            elif hasattr(v, "tolist"):
                row[f] = v.tolist()
            else:
                row[f] = list(v)
        out[_plain(k)] = _plain(row)
    return out


class Rollout:
    """The rollout actor: verl's ``AgentLoopWorkerTQ`` class body with a fake LLM call."""

    def __init__(self) -> None:
        import transfer_queue as tq
        from omegaconf import OmegaConf
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
        from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

        tq.init()  # attach, as AgentLoopWorkerTQ.__init__ does
        self.facade = bool(getattr(tq, "FACADE", False))
        cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class
        worker = cls.__new__(cls)
        worker.config = OmegaConf.create(
            {
                "actor_rollout_ref": {
                    "rollout": {
                        "n": N_SESSIONS,
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "top_k": -1,
                        "calculate_log_probs": False,
                        "agent": {"default_agent_loop": "single_turn_agent"},
                        "val_kwargs": {"n": 1, "top_p": 1.0, "top_k": -1, "temperature": 0},
                    }
                }
            }
        )
        worker.processor = None  # text only: no multi-modal inputs, 1-D position ids
        worker.reward_loop_worker_handles = None  # the fake loop sets reward_score: no reward call
        worker.distillation_enabled = False
        worker.background_tasks = set()
        done: dict[int, asyncio.Event] = {}  # per trajectory, in (prompt, session) order

        async def fake_run_agent_loop(self: Any, sampling_params: Any, trajectory: Any, **kwargs: Any) -> None:
            uid, sid = kwargs["uid"], kwargs["session_id"]
            p = int(uid[1:])
            turn = p * N_SESSIONS + sid
            if turn:  # trajectories finish one after another: the puts (so the listing) have one order
                await done.setdefault(turn - 1, asyncio.Event()).wait()
            prompt_ids = [11, 12, 13, 14][: 2 + p % 3]
            resp_len = 3 + sid + p  # a dense [1, L] put per session, L varying
            output = AgentLoopOutput(
                prompt_ids=prompt_ids,
                response_ids=list(range(100 + p, 100 + p + resp_len)),
                response_mask=[1] * resp_len,
                reward_score=float((sid + p) % 2),
                num_turns=2,
                metrics=AgentLoopMetrics(),
                extra_fields={"min_global_steps": trajectory["step"], "max_global_steps": trajectory["step"]},
            )
            try:
                await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)
            finally:  # a failed put fails its prompt (verl's own handling), not the next trajectory
                done.setdefault(turn, asyncio.Event()).set()

        worker._run_agent_loop = types.MethodType(fake_run_agent_loop, worker)
        self.worker = worker

    async def generate(self, batch: Any) -> bool:
        await self.worker.generate_sequences(batch)
        while self.worker.background_tasks:  # fire-and-forget tasks: wait for them here
            await asyncio.gather(*list(self.worker.background_tasks))
        return self.facade


def main(backend: str, out_path: str) -> None:
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if backend != "transferqueue":
        import integrations.verl

        integrations.verl.install(backend)
    import ray

    if not ray.is_initialized():  # a tq:// deployment started one
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=bool(os.environ.get("VERL_STEPS_LOGS")))
    import transfer_queue as tq

    if backend == "transferqueue":
        tq.init()
    times["start"] = time.perf_counter() - t0

    import numpy as np
    import verl.utils.tensordict_utils as tu
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl.protocol import BatchData
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils.transferqueue_utils import tqbridge

    result: dict[str, Any] = {"backend": backend, "facade": bool(getattr(tq, "FACADE", False))}

    # 1-2. prompts, then the rollout actor
    t = time.perf_counter()
    batch = tu.get_tensordict(
        {
            "raw_prompt": np.array([[{"role": "user", "content": f"q{i}"}] for i in range(N_PROMPTS)], dtype=object),
            "data_source": np.array(["demo"] * N_PROMPTS, dtype=object),
            "reward_model": np.array([{"ground_truth": str(i)} for i in range(N_PROMPTS)], dtype=object),
            "index": np.array(list(range(N_PROMPTS)), dtype=object),
            "uid": np.array([f"u{i}" for i in range(N_PROMPTS)], dtype=object),
        }
    )
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    actor = ray.remote(Rollout).options(num_cpus=0).remote()

    class Manager:
        def generate_sequences(self, prompts: Any) -> None:
            result["rollout_actor_facade"] = ray.get(
                actor.generate.remote(prompts), timeout=float(os.environ.get("VERL_STEPS_TIMEOUT", 300))
            )

    trainer = types.SimpleNamespace(global_steps=1, trainer_mode="sync", agent_loop_manager=Manager())
    PPOTrainer._submit_batch_to_rollout(trainer, batch)
    times["rollout"] = time.perf_counter() - t
    result["listing_after_rollout"] = _plain(tq.kv_list())

    # 3. one GRPO step
    class WorkerGroup:
        """Two data-parallel ranks run in-process through verl's own dispatch helpers."""

        def __init__(self) -> None:
            self._dispatch_info = {"actor": list(range(DP))}  # what _balance_batch asks the group
            self.calls: list[Any] = []

        @staticmethod
        def _log_prob_fn(td: Any) -> Any:
            import torch

            ids = td["input_ids"]
            lp = torch.nested.nested_tensor_from_jagged(-(ids.values().float() % 7 + 1) / 10, ids.offsets())
            ent = torch.nested.nested_tensor_from_jagged(ids.values().float() % 3 / 4, ids.offsets())
            return TensorDict({"log_probs": lp, "entropy": ent}, batch_size=ids.shape[0])

        def compute_log_prob(self, meta: Any) -> Any:
            self.calls.append(["compute_log_prob", _plain(meta.keys), _plain(sorted(meta.extra_info))])
            chunks = BatchData(meta).chunk(DP)  # KVBatchMeta -> BatchMeta per rank
            outs = [tqbridge()(self._log_prob_fn)(c) for c in chunks]  # each rank: get, run, put
            return BatchData(list(outs)).concat()  # -> KVBatchMeta

        def update_actor(self, meta: Any) -> Any:
            td = tq.kv_batch_get(
                keys=meta.keys, partition_id=meta.partition_id, select_fields=["advantages", "old_log_probs"]
            )
            self.calls.append(["update_actor", _plain(meta.keys), sorted(td.keys())])
            return {"metrics": {"mfu": 0.0, "pg_loss": [0.1], "grad_norm": [1.0]}}

    class Trainer(PPOTrainer):
        def on_step_end(self) -> None:
            return

        def on_sample_end(self) -> None:
            return

    tr = Trainer.__new__(Trainer)
    tr.config = OmegaConf.create(
        {
            "algorithm": {
                "adv_estimator": "grpo",
                "use_kl_in_reward": False,
                "rollout_correction": None,
                "gamma": 1.0,
                "lam": 1.0,
                "norm_adv_by_std_in_grpo": True,
            },
            "actor_rollout_ref": {
                "actor": {
                    "ppo_mini_batch_size": 2,
                    "loss_agg_mode": "token-mean",
                    "loss_scale_factor": None,
                    "calculate_entropy": True,
                    "entropy_coeff": 0.0,
                    "ppo_epochs": 1,
                    "data_loader_seed": 1,
                    "shuffle": False,
                },
                "rollout": {"n": N_SESSIONS, "temperature": 1.0, "calculate_log_probs": False},
                "model": {},
            },
            "trainer": {"critic_warmup": 0},
            "data": {"train_batch_size": N_PROMPTS},
        }
    )
    tr.tokenizer = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    tr.use_critic = False
    tr.use_reference_policy = True
    tr.ref_in_actor = True
    tr.global_steps = 1
    tr.replay_buffer = ReplayBuffer(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        poll_interval=0.05,
    )
    tr.reward_loop_manager = types.SimpleNamespace(reward_loop_worker_handles=[object()])  # no colocated reward
    tr.actor_rollout_wg = WorkerGroup()
    tr._rollout_moe_lb_metrics_accumulator = None
    tr.resource_pool_manager = types.SimpleNamespace(get_n_gpus=lambda: 1)
    metrics: dict[str, Any] = {}
    timing: dict[str, float] = {}
    t = time.perf_counter()
    step = tr._step_once(metrics, timing, N_PROMPTS)
    times["step"] = time.perf_counter() - t
    result["step_meta"] = {
        "keys": _plain(step.keys),
        "tags": _plain(step.tags),
        "fields": step.fields,
        "partition_id": step.partition_id,
    }
    result["worker_calls"] = tr.actor_rollout_wg.calls
    result["rows"] = _read(tq, step.keys, step.partition_id)
    timing["step"] = times["step"]
    tr._compute_metrics(step, metrics, timing, global_steps=1, epoch=0)
    result["metrics"] = {k: _plain(v) for k, v in sorted(metrics.items()) if not k.startswith(("timing", "perf"))}
    result["listing_before_clear"] = _plain(tq.kv_list())
    t = time.perf_counter()
    tq.kv_clear(keys=step.keys, partition_id=step.partition_id)  # trainer_base.py:511
    times["clear"] = time.perf_counter() - t
    result["listing_after_clear"] = _plain(tq.kv_list())
    result["seconds"] = times
    tq.close()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
