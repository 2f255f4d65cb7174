"""Synchronous GRPO and PPO end to end: a rollout actor and two FSDP2 trainer actors (gloo) on a real
local Ray, rows through real Mooncake and TransferQueue deployments, checked against the same runs
with the tensors passed through the driver.

One Ray (the test process's ``ray_cluster``) and one set of actors serve every run of the module;
each run rebuilds the models from its seed (``Cluster.reset``). The test that kills a trainer runs
last: it leaves the group dead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from rl_checks import check_tensorboard, check_trainer_times
from test_math import ref_gae  # the per-row scalar GAE loop (a sibling test module)

import dataplane
from dataplane.columns import read_columns
from integrations.rl.controller import AsyncGRPO
from integrations.rl.conventions import ADVANTAGES, INPUT_IDS, LOSS_MASK, RETURNS, REWARD, VALUES
from integrations.rl.examples import grpo_tiny, ppo_tiny
from integrations.rl.grpo import GRPO, GRPOConfig
from integrations.rl.policy import ActorFailure
from integrations.rl.rollout_actor import RolloutActor
from integrations.rl.sync_loop import StepRecord
from integrations.rl.trainer_actor import row_fingerprint

pytest.importorskip("ray", reason="needs Ray: pip install 'dataplane[tq]'")
pytest.importorskip("transfer_queue", reason="needs TransferQueue: pip install 'dataplane[tq]'")
pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.tq, pytest.mark.mooncake]

OPTS = grpo_tiny.Options(steps=5, prompts_per_step=4, group_size=8, seed=3, progress=False)
BACKENDS = ["mooncake://local", "tq://?backend=simple"]


@pytest.fixture(scope="module")
def tq_owner(ray_cluster: None) -> Iterator[dataplane.DataPlaneClient]:
    with dataplane.connect("tq://?backend=simple") as client:  # on the test process's shared Ray
        yield client


@pytest.fixture(scope="module")
def mooncake_owner(tq_owner: Any) -> Iterator[dataplane.DataPlaneClient]:
    with dataplane.connect("mooncake://local") as client:
        yield client


@pytest.fixture(scope="module")
def owners(tq_owner: Any, mooncake_owner: Any) -> dict[str, dataplane.DataPlaneClient]:
    return {"tq://?backend=simple": tq_owner, "mooncake://local": mooncake_owner}


@pytest.fixture(scope="module")
def cluster(owners: Any) -> Iterator[grpo_tiny.Cluster]:  # stopped before the stores its actors use
    c = grpo_tiny.Cluster.start(OPTS)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def inline_run(cluster: grpo_tiny.Cluster) -> dict[str, Any]:
    return grpo_tiny.run(replace(OPTS, transport="inline"), cluster=cluster)


class StepChecker:
    """Looks at the store around every step of a data-plane run, through a client of its own (the
    driver's byte count stays the driver's)."""

    def __init__(self, grpo_client: dataplane.DataPlaneClient, policy: Any) -> None:
        self.client = dataplane.connect(grpo_client.url)
        self.records: list[StepRecord] = []
        self.stored_fingerprints: dict[str, int] = {}
        self.sampled_with: set[int] = set()  # weight_version tags of the rows trained in the current step
        self._train_chunk = policy.train_chunk

    def train_chunk(self, meta: Any, **kw: Any) -> Any:
        """The policy's train_chunk, after noting the rows the store holds for the chunk's keys."""
        ids = read_columns(self.client, meta, [INPUT_IDS])[INPUT_IDS]
        self.stored_fingerprints.update({k: row_fingerprint(ids[i]) for i, k in enumerate(meta.keys)})
        self.sampled_with.update(t["weight_version"] for t in meta.tags)
        return self._train_chunk(meta, **kw)

    def on_step(self, record: StepRecord, grpo: GRPO) -> None:
        self.records.append(record)
        if record.metrics:  # sampled with the weights of the step before: synced after every step
            assert self.sampled_with == {record.version - 1}
        self.sampled_with = set()
        assert not self.client.kv_list(record.partition_id).get(record.partition_id)  # nothing left behind

    def close(self) -> None:
        self.client.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dataplane_run_equals_the_inline_run_bit_for_bit(
    backend: str, cluster: grpo_tiny.Cluster, owners: dict[str, Any], inline_run: dict[str, Any], monkeypatch: Any
) -> None:
    checker = StepChecker(owners[backend], cluster.policy)
    monkeypatch.setattr(cluster.policy, "train_chunk", checker.train_chunk)
    try:
        doc = grpo_tiny.run(
            replace(OPTS, backend=backend), cluster=cluster, client=owners[backend], on_step=checker.on_step
        )
    finally:
        checker.close()

    # parity: the same algorithm, plan and seeds without the data plane ends with the same bits
    assert doc["param_sha256"] == inline_run["param_sha256"]
    assert [s["reward_mean"] for s in doc["steps"]] == [s["reward_mean"] for s in inline_run["steps"]]
    assert [s["loss"] for s in doc["steps"]] == [s["loss"] for s in inline_run["steps"]]
    assert inline_run["bytes_get"] == inline_run["bytes_put"] == 0  # inline moved nothing through a store

    # the driver reads only per-row scalars (here: none at all) while the trainers read every row
    assert doc["bytes_get"] > 0
    assert doc["driver_bytes_get"] < 0.01 * doc["bytes_get"]

    # per step, each trainer rank's calls split into moving data and computing; through the data plane
    # the reads and write-backs take time, and the run's figures are the steps' sums
    check_trainer_times(doc, data_plane=True)
    check_trainer_times(inline_run, data_plane=False)
    assert doc["device"] == "cpu" and [t["backend"] for t in doc["trainers"]] == ["gloo"] * OPTS.dp
    assert {t["device"] for t in doc["trainers"]} == {"cpu"}

    trained_versions = 0
    for record in checker.records:
        # dynamic sampling dropped exactly the groups whose rewards are all equal
        expected = [u for u, rs in record.group_rewards.items() if len(set(rs)) == 1]
        assert record.dropped_groups == expected
        kept = {u for u in record.group_rewards if u not in expected}
        assert record.rows_trained == OPTS.group_size * len(kept)
        trained_keys: list[str] = []
        for chunk in record.chunks:
            counts = {len(report.microbatches) for report in chunk.reports}
            assert len(counts) == 1  # every DP rank ran the same number of microbatches
            for shard, report in zip(chunk.shards, chunk.reports, strict=True):
                plan = shard.extra_info["microbatches"]
                planned = [[shard.keys[i] for i in mb] for mb in plan]
                assert report.microbatches[: len(planned)] == planned  # the plan's rows, in the plan's order
                assert all(not mb for mb in report.microbatches[len(planned) :])  # then only dummies
                for keys, prints in zip(report.microbatches, report.fingerprints, strict=True):
                    # ... and those are the rows the store holds under those keys
                    assert prints == [checker.stored_fingerprints[k] for k in keys]
                    trained_keys += keys
        assert sorted(trained_keys) == sorted(f"{u}_g{i}" for u in kept for i in range(OPTS.group_size))
        trained_versions += bool(record.metrics)
        assert record.version == trained_versions  # the version moves once per finished step
    assert len(checker.records) == OPTS.steps


def test_split_and_monolithic_steps_agree(cluster: grpo_tiny.Cluster, mooncake_owner: Any, tmp_path: Any) -> None:
    opts = replace(OPTS, steps=3)
    split = grpo_tiny.run(replace(opts, tensorboard=str(tmp_path / "tb")), cluster=cluster, client=mooncake_owner)
    tags = check_tensorboard(tmp_path / "tb", 3, ("reward", "policy", "kl", "time", "bytes", "rows"))
    assert not any(t.startswith(("value/", "async/")) for t in tags)
    mono = grpo_tiny.run(replace(opts, train_step="monolithic"), cluster=cluster, client=mooncake_owner)
    assert split["train_step"] == "split" and mono["train_step"] == "monolithic"
    assert [s["version"] for s in split["steps"]] == [s["version"] for s in mono["steps"]]
    assert split["steps"][-1]["version"] >= 1  # something trained
    # chunks are sharded on their own: other row placements, other summation order -> rounding only
    assert split["param_norm"] == pytest.approx(mono["param_norm"], rel=1e-6)

    import ray

    policy = cluster.policy
    version = policy.version
    policy.begin(GRPOConfig().loss())
    policy.abort()  # an aborted step moves no version, on the driver or on any rank
    policy.abort()  # idempotent
    assert policy.version == version == mono["steps"][-1]["version"]
    assert ray.get([a.version.remote() for a in policy.actors]) == [version] * len(policy.actors)
    assert policy.param_digest().norm == mono["param_norm"]


# monolithic steps: one call per optimizer step (the split path is the GRPO tests'); 8 optimizer steps per
# PPO step would otherwise take 4 calls each
PPO_OPTS = replace(
    ppo_tiny.DEFAULTS, steps=5, prompts_per_step=4, group_size=8, seed=3, progress=False, train_step="monolithic"
)


def scalar_gae_check(client: dataplane.DataPlaneClient, meta: Any, gamma: float, lam: float) -> None:
    """The advantages and returns the trainers wrote equal a per-row scalar loop on the stored values,
    with the row's reward on its last generated token."""
    got = read_columns(client, meta, [VALUES, LOSS_MASK, REWARD, ADVANTAGES, RETURNS])
    for i, n in enumerate(meta.sequence_lengths):
        mask = got[LOSS_MASK][i, :n].tolist()
        r = [0.0] * n
        r[max(t for t in range(n) if mask[t])] = float(got[REWARD][i])
        want_a, want_r = ref_gae(r, got[VALUES][i, :n].double().tolist(), gamma, lam)
        torch.testing.assert_close(
            got[ADVANTAGES][i, :n].double(), torch.tensor(want_a, dtype=torch.float64), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            got[RETURNS][i, :n].double(), torch.tensor(want_r, dtype=torch.float64), rtol=1e-5, atol=1e-5
        )


def test_ppo_dataplane_run_equals_the_inline_run_bit_for_bit(
    cluster: grpo_tiny.Cluster, mooncake_owner: Any, monkeypatch: Any, tmp_path: Any
) -> None:
    """Also: the advantage stage on the trainers (each DP shard's leader reads values, loss_mask and
    reward, writes advantages and returns) equals a per-row scalar GAE loop, for random gamma and
    lambda and then the run's own (written last, so the run goes on with its own)."""
    inline = ppo_tiny.run(replace(PPO_OPTS, transport="inline"), cluster=cluster)
    records: list[StepRecord] = []
    original, pairs = cluster.policy.sequence_gae, torch.rand(5, 2, generator=torch.Generator().manual_seed(7))

    def sequence_gae(meta: Any, *, gamma: float, lam: float, **kw: Any) -> Any:
        for g, lm in (pairs[len(records)].tolist(), (gamma, lam)):  # a random pair, then the run's
            out = original(meta, gamma=g, lam=lm, **kw)
            scalar_gae_check(mooncake_owner, meta, g, lm)
        generated = sum(n - 4 for n in meta.sequence_lengths)  # 4-token prompts
        assert set(out[0].fields) >= {ADVANTAGES, RETURNS} and out[1]["count"] == generated
        return out

    monkeypatch.setattr(cluster.policy, "sequence_gae", sequence_gae)

    def on_step(record: StepRecord, loop: Any) -> None:
        records.append(record)
        assert not mooncake_owner.kv_list(record.partition_id).get(record.partition_id)

    board = tmp_path / "tb"
    doc = ppo_tiny.run(
        replace(PPO_OPTS, tensorboard=str(board)), cluster=cluster, client=mooncake_owner, on_step=on_step
    )
    check_tensorboard(board, PPO_OPTS.steps, ("reward", "policy", "value", "time", "bytes"))
    assert doc["algorithm"] == "ppo" and len(records) == PPO_OPTS.steps
    assert doc["param_sha256"] == inline["param_sha256"]
    assert doc["value_param_sha256"] == inline["value_param_sha256"]
    for a, b in zip(doc["steps"], inline["steps"], strict=True):
        assert a["value_loss"] == b["value_loss"]
        # per-shard sums added on the driver vs one sum over the batch: float64 rounding only
        assert a["explained_variance"] == pytest.approx(b["explained_variance"], rel=1e-9)
    # two epochs x two minibatches: four optimizer steps of each model per PPO step
    assert [s["version"] for s in doc["steps"]] == [4 * (i + 1) for i in range(PPO_OPTS.steps)]
    assert doc["bytes_get"] > 0 and doc["driver_bytes_get"] < 0.01 * doc["bytes_get"]


def test_memory_is_refused(cluster: grpo_tiny.Cluster) -> None:
    with pytest.raises(dataplane.InvalidArgument, match="one process"):
        grpo_tiny.run(replace(OPTS, backend="memory://"), cluster=cluster)
    assert grpo_tiny.main(["--backend", "memory://", "--steps", "1"]) == 2


def test_a_factory_that_builds_no_worker_is_refused_on_the_ranks_and_the_group_stopped(
    cluster: grpo_tiny.Cluster,
) -> None:
    """The trainer actors take any RLWorkerMixin; a factory whose class the driver cannot tell (a lambda)
    and that builds something else is refused on the ranks with the typed error, and the spawned
    group's actors are stopped (their CPUs free again)."""
    import ray

    from integrations.rl.policy import Policy

    free = ray.available_resources().get("CPU", 0.0)
    with pytest.raises(dataplane.InvalidArgument, match=r"built a Linear, not an RLWorkerMixin.*MegatronRLWorkerMixin"):
        Policy.spawn({"policy": lambda: torch.nn.Linear(2, 2)}, dp=2, num_cpus=0.25, timeout_s=120)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) >= free


def test_rollout_actor_writes_keys_tags_and_token_aligned_fields() -> None:
    """The rollout class in this process (its Ray wrapper adds nothing): first_write's keys and tags,
    rewards that match the tokens, the same tokens for the same seed and weights."""
    from integrations.rl.rollout_actor import RolloutActor

    opts = OPTS
    actor = RolloutActor(opts.rollout_model(), opts.task(), prompts_per_step=3, group_size=4, max_new_tokens=6, seed=5)
    actor.load_weights(dict(actor.model.named_parameters()), version=7)
    with dataplane.connect() as client:
        actor._client = client  # in-process: the memory store is fine here
        out = actor.rollout(2, "p")
        again = actor.rollout(2, "q", write=False)
        meta = out.meta
        assert meta.keys == tuple(f"s2p{i}_g{j}" for i in range(3) for j in range(4))
        assert [t["uid"] for t in meta.tags] == [f"s2p{i}" for i in range(3) for _ in range(4)]
        assert [t["sample_idx"] for t in meta.tags] == [j for _ in range(3) for j in range(4)]
        assert {t["weight_version"] for t in meta.tags} == {7}
        assert again.meta.keys == meta.keys and again.meta.sequence_lengths == meta.sequence_lengths
        assert again.data is not None and out.data is None
        rows = read_columns(client, meta, [INPUT_IDS, REWARD])
        assert torch.equal(rows[REWARD], out.rewards) and torch.equal(out.rewards, again.rewards)
        task = opts.task()
        for i, n in enumerate(meta.sequence_lengths or ()):
            row = rows[INPUT_IDS][i][:n].tolist()
            assert row == again.data[INPUT_IDS][i][:n].tolist()
            assert out.rewards[i].item() == task.reward(row[:4], row[4:])
    # a group's rows do not depend on the call that sampled it (async rollouts ask for groups one by one)
    alone = actor.rollout_groups([(2, 1)], "p", write=False)
    assert alone.meta.keys == meta.keys[4:8] and alone.data is not None
    for name in (INPUT_IDS, LOSS_MASK, REWARD):  # gen_logprobs may differ in the last bit (another batch)
        assert torch.equal(alone.data[name], again.data[name][4:8]), name
    with pytest.raises(dataplane.InvalidArgument, match="distinct"):
        actor.rollout_groups([(2, 1), (2, 1)], "p", write=False)


def test_gather_names_who_failed_and_never_waits_past_its_timeout(cluster: grpo_tiny.Cluster) -> None:
    """Calls to one threaded actor stand in for a group's members (one process start, not one per call)."""
    import ray

    from integrations.rl.policy import ActorTimeout, gather

    class Member:
        def call(self, behaviour: str) -> int:
            if behaviour == "raise":
                raise dataplane.KeyNotFound("row 'a' is gone")
            if behaviour == "hang":
                time.sleep(60)
            return 1

    actor = ray.remote(Member).options(num_cpus=0.01, max_concurrency=8).remote()
    member = actor.call
    broken: list[str] = []
    try:
        assert gather([member.remote("ok"), member.remote("ok")], timeout_s=60, what="call") == [1, 1]
        with pytest.raises(dataplane.KeyNotFound, match="row 'a' is gone"):  # all done: the typed error as is
            gather([member.remote("raise"), member.remote("ok")], timeout_s=30, what="call")
        t0 = time.monotonic()
        with pytest.raises(ActorTimeout, match="rank 1 did not answer within 2 s"):
            gather(
                [member.remote("ok"), member.remote("hang")],
                timeout_s=2,
                what="call",
                on_broken=lambda: broken.append("t"),
            )
        with pytest.raises(ActorFailure, match=r"rank 0 raised KeyNotFound.*rank 1 did not finish") as info:
            gather(
                [member.remote("raise"), member.remote("hang")],
                timeout_s=30,
                what="call",
                grace_s=0.5,
                on_broken=lambda: broken.append("f"),
            )
        assert isinstance(info.value.__cause__, dataplane.KeyNotFound)
        assert time.monotonic() - t0 < 20 and broken == ["t", "f"]
    finally:
        ray.kill(actor)


def test_init_local_ray_checks_its_arguments_and_leaves_a_running_ray_alone(cluster: grpo_tiny.Cluster) -> None:
    from dataplane.local_ray import init_local_ray

    for bad in (0, 1.5, True):
        with pytest.raises(dataplane.InvalidArgument, match="num_cpus"):
            init_local_ray(bad)  # type: ignore[arg-type]
    with pytest.raises(dataplane.InvalidArgument, match="sets address itself"):
        init_local_ray(2, address="auto")
    assert init_local_ray(2) is False  # the module's Ray runs already: nothing changes


# -- asynchronous GRPO (the controller actor over the same trainers) -----------------------------------
ASYNC_OPTS = replace(OPTS, algorithm="grpo_async")
SCRIPTED_OPTS = replace(ASYNC_OPTS, rollout_actors=2)  # the real rollout actor and a scripted one


class ScriptedRollout(RolloutActor):
    """A real rollout actor (it samples and writes real rows) that follows a script per call: sleep
    ``delay_s`` first; at the calls in ``fail_at`` write the first group's rows and raise; at call
    ``die_at`` end its process; call ``hold_at`` waits (at most 120 s) until the file ``hold`` exists."""

    def script(
        self,
        delay_s: float = 0.0,
        fail_at: tuple[int, ...] = (),
        die_at: int | None = None,
        hold_at: int | None = None,
        hold: str = "",
    ) -> None:
        self.delay_s, self.fail_at, self.die_at, self.calls = delay_s, fail_at, die_at, 0
        self.hold_at, self.hold = hold_at, hold

    def rollout_groups(self, groups: Any, partition_id: str, *, write: bool = True) -> Any:
        self.calls += 1
        time.sleep(self.delay_s)
        deadline = time.monotonic() + 120
        while self.calls == self.hold_at and not os.path.exists(self.hold) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.calls == self.die_at:
            os._exit(1)
        if self.calls in self.fail_at:  # a write that stored some rows, then failed
            super().rollout_groups(groups[:1], partition_id, write=write)
            raise RuntimeError(f"scripted failure of call {self.calls}, after writing its first group")
        return super().rollout_groups(groups, partition_id, write=write)


@pytest.fixture(scope="module")
def scripted(cluster: grpo_tiny.Cluster) -> Iterator[grpo_tiny.Cluster]:
    """The module's trainers and rollout actor, and a scripted rollout actor (``rollouts[1]``)."""
    import ray

    opts = SCRIPTED_OPTS
    kw = {"prompts_per_step": opts.prompts_per_step, "group_size": opts.group_size}
    actor = ray.remote(ScriptedRollout).options(num_cpus=0.1).remote(opts.rollout_model(), opts.task(), **kw)
    yield grpo_tiny.Cluster(cluster.policy, [cluster.rollout, actor], opts)
    ray.kill(actor)


def check_the_run_left_nothing(stats: dict[str, Any], client: Any, steps: int) -> None:
    """What every asynchronous run must leave: each reservation ended once (a commit or a release),
    every committed group was removed, the buffer never held more than its capacity, and the store
    holds nothing of the run."""
    ends, buf = stats["reservations_ended"], stats["buffer"]
    assert ends["committed"] + ends["released"] == buf["reserved"] and not stats["reservations_ended_twice"]
    assert buf["committed"] == ends["committed"] == buf["removed"] and buf["released"] == ends["released"]
    assert 0 < stats["peak_occupancy"] <= stats["capacity"]
    assert not any(client.kv_list().values())
    assert stats["steps"] == steps


def scripted_run(
    cluster: grpo_tiny.Cluster, opts: Any, client: Any, after_step: Any = None
) -> tuple[dict[str, Any], list[Any]]:
    """The controller in this process (the example runs the same class as a Ray actor) over the
    cluster's trainers and scripted rollout actors; ``after_step(i)`` runs after step ``i``."""
    cluster.reset(opts, client.url)
    controller = AsyncGRPO(cluster.policy, cluster.rollouts, opts.async_config(), url=client.url)
    records = []
    try:
        controller.start()
        for i in range(opts.steps):
            records.append(controller.step())
            if after_step is not None:
                after_step(i)
    finally:
        stats = controller.stop()
    check_the_run_left_nothing(stats, client, opts.steps)
    return stats, records


def trained_staleness(record: Any) -> list[int]:
    """``version - weight_version`` of every row that reached a trainer in the step, from the shards
    the trainers were sent (not from the controller's own count)."""
    before = record.version - bool(record.metrics)
    return [before - t["weight_version"] for chunk in record.chunks for shard in chunk.shards for t in shard.tags]


def test_async_without_staleness_trains_what_sync_grpo_trains(
    cluster: grpo_tiny.Cluster, mooncake_owner: Any, inline_run: dict[str, Any], tmp_path: Any
) -> None:
    """The example's path: the controller as a Ray actor."""
    records: list[Any] = []
    opts = replace(ASYNC_OPTS, max_staleness=0, tensorboard=str(tmp_path / "tb"))
    doc = grpo_tiny.run(opts, cluster=cluster, client=mooncake_owner, on_step=lambda r, _: records.append(r))
    check_tensorboard(tmp_path / "tb", opts.steps, ("reward", "policy", "kl", "async", "time", "bytes"))
    check_the_run_left_nothing(doc["controller"], mooncake_owner, opts.steps)
    assert doc["param_sha256"] == inline_run["param_sha256"]  # bit for bit
    assert [s["reward_mean"] for s in doc["steps"]] == [s["reward_mean"] for s in inline_run["steps"]]
    assert [s["loss"] for s in doc["steps"]] == [s["loss"] for s in inline_run["steps"]]
    assert all(trained_staleness(r) == [0] * r.rows_trained for r in records)
    assert doc["max_trained_staleness"] == 0 and doc["driver_bytes_get"] == 0 < doc["bytes_get"]
    check_trainer_times(doc, data_plane=True)  # the controller's steps report them too


def test_async_in_order_trains_groups_in_issue_order_within_capacity(
    scripted: grpo_tiny.Cluster, mooncake_owner: Any
) -> None:
    import ray

    ray.get(scripted.rollouts[1].script.remote(0.4), timeout=60)
    opts = replace(SCRIPTED_OPTS, in_order=True, max_staleness=1, capacity=OPTS.prompts_per_step + 2)
    stats, records = scripted_run(scripted, opts, mooncake_owner)
    issued = [i for r in records for i in r.group_ids]
    assert issued == sorted(issued)  # the slow actor's groups hold back every later one
    assert all(0 <= x <= 1 for r in records for x in trained_staleness(r))
    assert stats["peak_occupancy"] <= OPTS.prompts_per_step + 2


def test_async_window_aborts_stale_rollouts_and_survives_failed_ones_and_a_dead_actor(
    scripted: grpo_tiny.Cluster, mooncake_owner: Any, tmp_path: Any
) -> None:
    """The scripted actor's first call fails after writing a group, its second is held until the trainer
    is 4 versions on (too stale: aborted at a weight sync, released when it lands), its third kills it."""
    import ray

    hold = tmp_path / "go"
    ray.get(scripted.rollouts[1].script.remote(fail_at=(1,), hold_at=2, hold=str(hold), die_at=3), timeout=60)

    def after_step(i: int) -> None:
        if i == 3:
            hold.touch()

    stats, records = scripted_run(scripted, replace(SCRIPTED_OPTS, max_staleness=1), mooncake_owner, after_step)
    stale = [x for r in records for x in trained_staleness(r)]
    assert max(stale) == 1 and min(stale) == 0 and stats["max_trained_staleness"] == 1  # older weights were trained
    assert stats["aborted_groups"] >= 1  # the held call's groups, which landed too stale to train
    assert stats["lost_actors"] == ["rollout 1"]  # the run went on with the other actor
    assert stats["failed_rollouts"] == 2  # the call that failed and the one whose actor died
    # released: the aborted groups and those of the two failed calls (with the rows the first one wrote)
    assert stats["buffer"]["released"] >= stats["aborted_groups"] + 2
    assert records[-1].version == stats["version"] >= 1


def test_a_trainer_dying_mid_step_raises_a_typed_error_and_leaves_nothing(
    cluster: grpo_tiny.Cluster, mooncake_owner: Any, monkeypatch: Any
) -> None:
    """Last in the module: it kills the shared trainer group."""
    import ray

    cluster.reset(OPTS, mooncake_owner.url)
    policy = cluster.policy
    policy.timeout_s = 60.0
    grpo = GRPO(policy, cluster.rollout, GRPOConfig(kl_coef=OPTS.kl_coef), client=mooncake_owner)
    grpo.sync_weights()
    original = policy.train_chunk

    def train_chunk(meta: Any, **kw: Any) -> Any:  # rank 1 dies with the step open
        ray.kill(policy.actors[1], no_restart=True)
        return original(meta, **kw)

    monkeypatch.setattr(policy, "train_chunk", train_chunk)
    t0 = time.monotonic()
    with pytest.raises(ActorFailure, match="rank 1 died"):
        for step in range(OPTS.steps):  # the first step that trains meets the dead rank
            grpo.step(step)
    assert time.monotonic() - t0 < policy.timeout_s
    assert not any(mooncake_owner.kv_list().values())  # the driver cleared the step's partition
    assert policy.broken is not None
    with pytest.raises(ActorFailure, match="shut down"):
        policy.logprobs(dataplane.KVBatchMeta(partition_id="p", keys=["a"], sequence_lengths=[1]))


@pytest.mark.soak
@pytest.mark.parametrize("example", ["grpo_tiny", "grpo_async_tiny"])
def test_the_example_command_learns(example: str, tmp_path: Any) -> None:
    """The README's commands as a user runs them (a fresh process: its own Ray and Mooncake), 20 steps."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", f"integrations.rl.examples.{example}", "--steps", "20", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == "mooncake://local" and doc["transport"] == "dataplane" and len(doc["steps"]) == 20
    first, last3 = doc["steps"][0]["reward_mean"], [s["reward_mean"] for s in doc["steps"][-3:]]
    assert sum(last3) / 3 > first + 0.25, [s["reward_mean"] for s in doc["steps"]]
    assert doc["bytes_get"] > 0 and doc["driver_bytes_get"] < 0.01 * doc["bytes_get"]
    assert proc.stdout.count("step ") >= 20 and "reward" in proc.stdout.splitlines()[-2]
    if example == "grpo_async_tiny":  # the default --max-staleness 1
        assert doc["max_trained_staleness"] == 1 and all(s["staleness_max"] <= 1 for s in doc["steps"])
