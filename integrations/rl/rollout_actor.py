"""A rollout worker for the tiny model: sample with the current weights, score, write the rows.

:class:`RolloutActor` is a plain class; run it as a Ray actor (``ray.remote(RolloutActor)``). Each
:meth:`~RolloutActor.rollout` samples ``group_size`` responses for each of ``prompts_per_step``
prompts, each group with a generator of its own seeded from ``(seed, step, prompt)`` (the same seed
and weights give the same tokens, whatever ran before and whichever call or actor sampled the
group), scores them with the reward function, and writes them with
:func:`dataplane.columns.first_write`: keys ``f"{uid}_g{i}"``, tags ``uid``, ``sample_idx`` and
``weight_version``, token fields ``input_ids``, ``loss_mask`` and ``gen_logprobs`` plus ``reward`` per
row. It returns the meta and the per-row rewards only; the bulk stays in the store.

Weights arrive through :meth:`~RolloutActor.load_weights` (whole parameters by name, what a trainer
group's ``state_dict_ref`` holds); see :mod:`integrations.rl.weight_sync`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from tensordict import TensorDict
from torch import Tensor

from dataplane import InvalidArgument, KVBatchMeta
from dataplane.checks import check_int, check_number
from dataplane.columns import first_write
from integrations.rl.conventions import GEN_LOGPROBS, INPUT_IDS, LOSS_MASK, REWARD
from integrations.rl.metering import TrafficMeter
from integrations.rl.rollout import CountingTask, generate
from integrations.rl.workers.model import TinyCausalLM, TinyConfig

__all__ = ["RolloutActor", "RolloutResult", "group_seed", "rollout_meta"]

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
    """Samples from the policy model (unsharded, on the CPU) and writes scored rollouts.

    Args:
        config: the trainers' policy model: a :class:`~integrations.rl.workers.model.TinyConfig`, or a
            picklable callable that builds the model (e.g. a
            :class:`~integrations.rl.workers.hf.CausalLMPolicy`): an ``nn.Module`` with ``vocab_size``
            and ``step(input_ids, cache) -> (logits, cache)``, whose parameter names are the trainers'.
        task: prompts and the reward (default :class:`~integrations.rl.rollout.CountingTask`).
        prompts_per_step, group_size: prompts per rollout and samples per prompt.
        max_new_tokens, temperature: sampling.
        seed: the sampling seed (each group's generator is seeded from ``(seed, step, prompt)``).
        reward_fn: ``(prompt tokens, response tokens) -> float``; default ``task.reward``.
        threads: torch threads of this process.
        latency_s: idle seconds added to every rollout call (no CPU used): stands in for an inference
            engine on hardware of its own, to measure what overlapping rollouts with training buys.
    """

    def __init__(
        self,
        config: TinyConfig | Callable[[], torch.nn.Module],
        task: CountingTask | None = None,
        *,
        prompts_per_step: int = 8,
        group_size: int = 8,
        max_new_tokens: int = 6,
        temperature: float = 1.0,
        seed: int = 0,
        reward_fn: RewardFn | None = None,
        threads: int = 1,
        latency_s: float = 0.0,
    ) -> None:
        for name, value in (("prompts_per_step", prompts_per_step), ("group_size", group_size)):
            check_int(name, value, low=1)
        self.latency_s = check_number("latency_s", latency_s, low=0, high=3600, high_open=True)
        torch.set_num_threads(threads)
        self.config = config
        self.model: Any = TinyCausalLM(config) if isinstance(config, TinyConfig) else config()
        vocab = int(cast(Any, self.model).vocab_size)
        self.task = task or CountingTask(vocab_size=vocab)
        if self.task.vocab_size > vocab:
            raise InvalidArgument(f"the task's vocab_size {self.task.vocab_size} exceeds the model's {vocab}")
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.reward_fn: Callable[[Any, Any], float] = reward_fn or self.task.reward
        self.seed = seed
        self.weight_version = 0
        self.meter = TrafficMeter()
        self._client: Any = None

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
        """Load whole parameters by name (every parameter of the model, nothing else); returns ``version``."""
        own = dict(self.model.named_parameters())
        if set(params) != set(own):
            missing, extra = sorted(set(own) - set(params)), sorted(set(params) - set(own))
            raise InvalidArgument(
                f"weights do not fit the rollout model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(params[name])
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
        """Sample, score and write the groups ``(step, index)``: group ``(s, i)`` gets uid ``f"s{s}p{i}"``
        and its own generator, seeded from ``(seed, s, i)``, so its prompt and samples depend only on the
        seed, the group and the weights, not on which call or actor produced it, up to the batched
        forward's rounding (``gen_logprobs`` may differ in the last bit between batches of other
        sizes). Rows are uid-major in the order of ``groups``; see :meth:`rollout` for ``write``."""
        if write and self._client is None:
            raise InvalidArgument("this rollout actor has no data plane; connect(url) first, or pass write=False")
        uids = [f"s{s}p{i}" for s, i in groups]
        if not uids or len(set(uids)) != len(uids):
            raise InvalidArgument(f"rollout_groups needs distinct (step, index) groups, got {list(groups)[:8]}")
        t0 = time.perf_counter()
        gens = [torch.Generator().manual_seed(group_seed(self.seed, int(s), int(i))) for s, i in groups]
        prompts = torch.cat([self.task.prompts(1, generator=g) for g in gens]).repeat_interleave(self.group_size, dim=0)
        gen = generate(
            self.model,
            prompts,
            self.max_new_tokens,
            eos_id=self.task.eos_id,
            temperature=self.temperature,
            generator=gens,
        )
        mask = gen.loss_mask()
        tokens = gen.tokens * (torch.arange(gen.tokens.shape[1]) < gen.lengths[:, None])  # zeros past each row
        rewards = torch.tensor(
            [
                self.reward_fn(row[: gen.prompt_len], row[gen.prompt_len : n])
                for row, n in zip(tokens.tolist(), gen.lengths.tolist(), strict=True)
            ],
            dtype=torch.float32,
        )
        rows = TensorDict(
            {INPUT_IDS: tokens, LOSS_MASK: mask, GEN_LOGPROBS: gen.logprobs, REWARD: rewards},
            batch_size=[tokens.shape[0]],
        )
        if self.latency_s:
            time.sleep(self.latency_s)
        seconds = time.perf_counter() - t0
        tags = {"weight_version": self.weight_version}
        if not write:
            meta = rollout_meta(partition_id, uids, self.group_size, gen.lengths.tolist(), tags)
            return RolloutResult(meta=meta, rewards=rewards, data=rows, seconds=seconds)
        meta = first_write(
            self._client,
            rows,
            uids=uids,
            group_size=self.group_size,
            partition_id=partition_id,
            token_fields=TOKEN_FIELDS,
            lengths=gen.lengths,
            tags=tags,
        )
        return RolloutResult(meta=meta, rewards=rewards, data=None, seconds=seconds)

    def traffic(self) -> dict[str, float]:
        """This process's data-plane totals."""
        return self.meter.totals()
