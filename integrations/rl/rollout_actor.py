"""The rollout worker: sample with a rollout engine and the current weights, score, write the rows.

:class:`RolloutActor` is a plain class; run it as a Ray actor (``ray.remote(RolloutActor)``). It
takes any :class:`~integrations.rl.engines.RolloutEngine` and any :class:`~integrations.rl.tasks.Task`.
Each :meth:`~RolloutActor.rollout` asks the task for ``prompts_per_step`` prompts, each drawn with a
generator seeded from ``(seed, step, prompt)``, has the engine sample ``group_size`` completions of
each (with a sampling seed derived from the same), scores them with the task's reward, and writes
them with :func:`dataplane.columns.first_write`: keys ``f"{uid}_g{i}"``, tags ``uid``, ``sample_idx``
and ``weight_version``, token fields ``input_ids``, ``loss_mask`` and ``gen_logprobs`` plus ``reward``
per row. It returns the meta and the per-row rewards only; the bulk stays in the store.
:meth:`~RolloutActor.evaluate` decodes held-out prompts greedily and reports accuracy.

Weights arrive through :meth:`~RolloutActor.load_weights` (whole parameters by name, what a trainer
group's ``state_dict_ref`` holds); see :mod:`integrations.rl.weight_sync`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from tensordict import TensorDict
from torch import Tensor

from dataplane import InvalidArgument, KVBatchMeta
from dataplane.checks import check_int, check_number
from dataplane.columns import first_write
from integrations.rl.conventions import GEN_LOGPROBS, INPUT_IDS, LOSS_MASK, REWARD
from integrations.rl.engines import Completion, RolloutEngine, SamplingParams, TorchEngine, as_engine
from integrations.rl.metering import TrafficMeter
from integrations.rl.rollout import CountingTask, Prompt
from integrations.rl.tasks import Task
from integrations.rl.workers.model import TinyCausalLM, TinyConfig

__all__ = ["RolloutActor", "RolloutResult", "group_seed", "rollout_meta", "sample_seed"]

RewardFn = Callable[[Sequence[int], Sequence[int]], float]
TOKEN_FIELDS = (INPUT_IDS, LOSS_MASK, GEN_LOGPROBS)


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """What a rollout returns to the driver.

    Attributes:
        meta: the written rows (uid-major: row ``j`` is sample ``j % group_size`` of prompt ``j // group_size``).
        rewards: ``[rows]`` float32, per row.
        data: the rows' tensors (``[rows, width]``, zeros past each row's length) when the rollout was
            asked for them instead of writing (a trainer without a data plane); else None.
        seconds: time spent sampling and scoring, with the actor's ``latency_s`` (not writing).
    """

    meta: KVBatchMeta
    rewards: Tensor
    data: TensorDict | None
    seconds: float


def group_seed(seed: int, step: int, index: int) -> int:
    """The generator seed of group ``(step, index)`` of a run seeded ``seed``.

    >>> group_seed(0, 0, 1) != group_seed(0, 1, 0)
    True
    """
    return ((seed * 1_000_003 + step) * 65_537 + index) % 2**63


def sample_seed(group: int) -> int:
    """The engine's sampling seed for a group whose prompt was drawn with seed ``group``
    (:func:`group_seed`): another stream, so a prompt and its samples draw from different numbers.

    >>> sample_seed(5) != 5
    True
    """
    return (group * 6_364_136_223_846_793_005 + 1_442_695_040_888_963_407) % 2**63


def rollout_meta(
    partition_id: str,
    uids: Sequence[str],
    group_size: int,
    lengths: Sequence[int],
    tags: Mapping[str, Any],
    pad_to_multiple: int = 1,
) -> KVBatchMeta:
    """The meta :func:`~dataplane.columns.first_write` returns for these rows, without writing them
    (for a run without a data plane: the same keys, lengths, tags and plan inputs).

    >>> m = rollout_meta("p", ["u0"], 2, [5, 7], {"weight_version": 3})
    >>> m.keys, m.sequence_lengths, m.tags[1]
    (('u0_g0', 'u0_g1'), (5, 7), {'weight_version': 3, 'uid': 'u0', 'sample_idx': 1})
    """
    keys = [f"{u}_g{i}" for u in uids for i in range(group_size)]
    row_tags = [{**tags, "uid": u, "sample_idx": i} for u in uids for i in range(group_size)]
    return KVBatchMeta(
        partition_id=partition_id,
        keys=tuple(keys),
        sequence_lengths=tuple(int(n) for n in lengths),
        tags=tuple(row_tags),
        extra_info={"pad_to_multiple": pad_to_multiple, "group_size": group_size},
    )


class RolloutActor:
    """Samples with a rollout engine and writes scored rollouts.

    Args:
        engine: a :class:`~integrations.rl.engines.RolloutEngine` (:class:`~integrations.rl.engines.HFEngine`,
            your own), or what a :class:`~integrations.rl.engines.TorchEngine` samples with: a
            :class:`~integrations.rl.workers.model.TinyConfig`, or a picklable callable that builds the
            model (e.g. a :class:`~integrations.rl.workers.hf.CausalLMPolicy`) or the engine. Its
            parameter names are the trainers' (weights arrive by name).
        task: a :class:`~integrations.rl.tasks.Task`: prompts, stop tokens and the reward (default
            :class:`~integrations.rl.rollout.CountingTask` over the engine's vocabulary).
        prompts_per_step, group_size: prompts per rollout and samples per prompt.
        max_new_tokens, temperature, top_p: sampling (:class:`~integrations.rl.engines.SamplingParams`).
        seed: the sampling seed (each group's prompt and samples are drawn from seeds derived from
            ``(seed, step, prompt)``).
        reward_fn: ``(prompt tokens, completion tokens) -> float`` instead of ``task.score``.
        threads: torch threads of this process.
        latency_s: idle seconds added to every rollout call (no CPU used): stands in for an inference
            engine on hardware of its own, to measure what overlapping rollouts with training buys.
    """

    def __init__(
        self,
        engine: Any,
        task: Task | None = None,
        *,
        prompts_per_step: int = 8,
        group_size: int = 8,
        max_new_tokens: int = 6,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        reward_fn: RewardFn | None = None,
        threads: int = 1,
        latency_s: float = 0.0,
    ) -> None:
        for name, value in (("prompts_per_step", prompts_per_step), ("group_size", group_size)):
            check_int(name, value, low=1)
        self.latency_s = check_number("latency_s", latency_s, low=0, high=3600, high_open=True)
        torch.set_num_threads(threads)
        self.engine: RolloutEngine = as_engine(
            TorchEngine(TinyCausalLM(engine)) if isinstance(engine, TinyConfig) else engine
        )
        vocab = getattr(self.engine, "vocab_size", None)
        self.task: Task = task or CountingTask(vocab_size=int(cast(int, vocab)))
        need = getattr(self.task, "vocab_size", None)
        if vocab is not None and need is not None and int(need) > int(vocab):
            raise InvalidArgument(f"the task's vocab_size {need} exceeds the model's {vocab}")
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.sampling = SamplingParams(
            n=group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=self.task.stop_token_ids,
        )
        self.reward_fn = reward_fn
        self.seed = seed
        self.weight_version = 0
        self.meter = TrafficMeter()
        self._client: Any = None

    @property
    def model(self) -> Any:
        """The engine's model (engines that hold one in-process)."""
        return getattr(self.engine, "model", None)

    def connect(self, url: str | None) -> None:
        """Write to the data plane at ``url`` (a ``client.url``), or nowhere (``None``: return the tensors)."""
        self._client = self.meter.reconnect(self._client, url)

    def close(self) -> None:
        self.connect(None)

    def reset(self, seed: int) -> None:
        """Sample with ``seed`` from now on (weights stay until the next :meth:`load_weights`); the
        traffic totals (:meth:`traffic`) start over."""
        self.seed = seed
        self.meter.reset()

    def load_weights(self, params: Mapping[str, Tensor], version: int) -> int:
        """Load whole parameters by name into the engine (every parameter it has); returns ``version``."""
        self.engine.load_weights(params, int(version))
        self.weight_version = int(version)
        return self.weight_version

    def rollout(self, step: int, partition_id: str, *, write: bool = True) -> RolloutResult:
        """Sample, score and (``write=True``) write one step's rollouts into ``partition_id``: the
        groups ``(step, 0) .. (step, prompts_per_step - 1)`` of :meth:`rollout_groups`.

        With ``write=False`` nothing is written: the result carries the tensors and the meta the
        write would have returned (keys, lengths, tags), for a run without a data plane.
        """
        return self.rollout_groups([(step, i) for i in range(self.prompts_per_step)], partition_id, write=write)

    def rollout_groups(
        self, groups: Sequence[tuple[int, int]], partition_id: str, *, write: bool = True
    ) -> RolloutResult:
        """Sample, score and write the groups ``(step, index)``: group ``(s, i)`` gets uid ``f"s{s}p{i}"``,
        a prompt drawn with a generator seeded from ``(seed, s, i)`` and a sampling seed derived from
        it, so with an engine that seeds each prompt on its own (:class:`~integrations.rl.engines.TorchEngine`,
        vLLM) its rows depend only on the seed, the group and the weights, not on which call or actor
        produced it, up to the batched forward's rounding (``gen_logprobs`` may differ in the last bit
        between batches of other sizes). Rows are uid-major in the order of ``groups``; see
        :meth:`rollout` for ``write``."""
        if write and self._client is None:
            raise InvalidArgument("this rollout actor has no data plane; connect(url) first, or pass write=False")
        uids = [f"s{s}p{i}" for s, i in groups]
        if not uids or len(set(uids)) != len(uids):
            raise InvalidArgument(f"rollout_groups needs distinct (step, index) groups, got {list(groups)[:8]}")
        t0 = time.perf_counter()
        seeds = [group_seed(self.seed, int(s), int(i)) for s, i in groups]
        prompts = [self.task.prompt(torch.Generator().manual_seed(g)) for g in seeds]
        samples = [sample_seed(g) for g in seeds]
        outs = self.engine.generate([p.token_ids for p in prompts], self.sampling, samples)
        rows, lengths, rewards = self._rows(prompts, outs)
        if self.latency_s:
            time.sleep(self.latency_s)
        seconds = time.perf_counter() - t0
        tags = {"weight_version": self.weight_version}
        if not write:
            meta = rollout_meta(partition_id, uids, self.group_size, lengths.tolist(), tags)
            return RolloutResult(meta=meta, rewards=rewards, data=rows, seconds=seconds)
        meta = first_write(
            self._client,
            rows,
            uids=uids,
            group_size=self.group_size,
            partition_id=partition_id,
            token_fields=TOKEN_FIELDS,
            lengths=lengths,
            tags=tags,
        )
        return RolloutResult(meta=meta, rewards=rewards, data=None, seconds=seconds)

    def _rows(
        self, prompts: Sequence[Prompt], outs: Sequence[Sequence[Completion]]
    ) -> tuple[TensorDict, Tensor, Tensor]:
        """The rows of a rollout (prompt-major): ``input_ids`` (prompt, completion, zeros after),
        ``loss_mask`` on the completion, token-aligned ``gen_logprobs``, ``reward``; and the lengths."""
        if len(outs) != len(prompts) or any(len(o) != self.group_size for o in outs):
            raise InvalidArgument(
                f"the engine returned {[len(o) for o in outs]} completions; expected {self.group_size} per prompt"
            )
        width = max(len(p.token_ids) for p in prompts) + self.sampling.max_new_tokens
        n = len(prompts) * self.group_size
        tokens = torch.zeros(n, width, dtype=torch.int64)
        mask = torch.zeros(n, width, dtype=torch.int64)
        logprobs = torch.zeros(n, width, dtype=torch.float32)
        lengths = torch.zeros(n, dtype=torch.int64)
        rewards = torch.zeros(n, dtype=torch.float32)
        for i, (prompt, group) in enumerate(zip(prompts, outs, strict=True)):
            p = len(prompt.token_ids)
            for j, c in enumerate(group):
                r, end = i * self.group_size + j, p + len(c.token_ids)
                tokens[r, :p] = torch.tensor(prompt.token_ids, dtype=torch.int64)
                tokens[r, p:end] = c.token_ids
                mask[r, p:end] = 1
                logprobs[r, p:end] = c.logprobs
                lengths[r] = end
                ids = c.token_ids.tolist()
                rewards[r] = (
                    self.task.score(prompt, ids)
                    if self.reward_fn is None
                    else self.reward_fn(list(prompt.token_ids), ids)
                )
        rows = TensorDict({INPUT_IDS: tokens, LOSS_MASK: mask, GEN_LOGPROBS: logprobs, REWARD: rewards}, batch_size=[n])
        return rows, lengths, rewards

    def evaluate(self, n: int, *, max_new_tokens: int | None = None) -> dict[str, float]:
        """Greedy completions of the task's first ``n`` held-out prompts (:meth:`~integrations.rl.tasks.Task.eval_prompts`)
        with the current weights: ``eval_accuracy`` (the share that scores full marks, 1.0),
        ``eval_reward`` (the mean score) and ``eval_prompts``. Nothing is written."""
        prompts = self.task.eval_prompts(check_int("n", n, low=1))
        params = replace(
            self.sampling,
            n=1,
            temperature=0.0,
            top_p=1.0,
            max_new_tokens=max_new_tokens or self.sampling.max_new_tokens,
        )
        outs = self.engine.generate([p.token_ids for p in prompts], params, [0] * len(prompts))
        scores = [self.task.score(p, o[0].token_ids.tolist()) for p, o in zip(prompts, outs, strict=True)]
        return {
            "eval_accuracy": sum(s >= 1.0 for s in scores) / len(scores),
            "eval_reward": sum(scores) / len(scores),
            "eval_prompts": float(len(scores)),
        }

    def traffic(self) -> dict[str, float]:
        """This process's data-plane totals."""
        return self.meter.totals()
