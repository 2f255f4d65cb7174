"""Worker mixin: fetch policies, leader failure propagation, leader-only write-back, microbatches.

The multi-process tests start real processes (forked from a forkserver) that form a gloo group of 4: two
replica groups of two ranks ({0, 1} and {2, 3}), each made with ``new_group`` on every rank. There
is no cross-process store yet, so each rank opens its own ``memory://`` store and fills it
deterministically with the same rows: every rank sees the same data, as it would through a shared
store. ``tests/worker/test_worker_gpu.py`` runs the same scenarios over NCCL.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from tensordict import NonTensorStack, TensorDict

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.codec.wire import Layout
from dataplane.errors import (
    DataPlaneError,
    InvalidArgument,
    KeyNotFound,
    SchemaError,
)
from dataplane.meta import KVBatchMeta
from dataplane.observability import CallEvent, ObservedClient
from dataplane.testing.ranks import run_ranks
from dataplane.worker import (
    DataPlaneWorkerMixin,
    Descriptor,
    DeviceMeshReplicaMixin,
    ErrorInfo,
    FetchStats,
    error_from_info,
    is_leader_from_mesh,
    iter_microbatches,
    replica_group_from_mesh,
)
from dataplane.worker.descriptor import batch_digest, columns_from_jagged, plan_buffers, stage, unstage

PARTITION = "train"
FIELDS = ["ids", "logp", "mask", "adv", "emb", "msgs"]
PAD = {"ids": -1, "logp": 0.0, "mask": False}
GROUP = 2  # ranks per replica group


# -- data every rank builds identically ------------------------------------------------------------
def make_rows(n: int = 12, seed: int = 0) -> tuple[list[str], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 17, (n,), generator=g)]
    lengths[1] = 0  # an empty row
    ids = [torch.randint(0, 50_000, (k,), generator=g) for k in lengths]
    logp = [(-torch.rand(k, generator=g)).to(torch.bfloat16) for k in lengths]
    mask = [torch.rand(k, generator=g) > 0.3 for k in lengths]
    msgs = [{"role": "user", "turn": i, "text": f"q{i}" * (i % 3), "tags": [i, None]} for i in range(n)]
    fields = {
        "ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
        "logp": torch.nested.as_nested_tensor(logp, layout=torch.jagged),
        "mask": torch.nested.as_nested_tensor(mask, layout=torch.jagged),
        "adv": torch.randn(n, generator=g),
        "emb": torch.randn(n, 3, generator=g),
        "msgs": msgs,
    }
    return [f"u{i}_g{i % 4}" for i in range(n)], fields


def filled_client(n: int = 12) -> tuple[DataPlaneClient, KVBatchMeta]:
    client = dataplane.connect("memory://")
    keys, fields = make_rows(n)
    meta = client.kv_batch_put(keys, fields, partition_id=PARTITION)
    longest = max(meta.sequence_lengths or (0,))
    return client, meta.with_extra_info(pad_to_length=-(-longest // 8) * 8 + 8)


def shard_of(meta: KVBatchMeta, dp_rank: int, dp_size: int) -> KVBatchMeta:
    shard = meta.subset(list(range(dp_rank, meta.size, dp_size)))
    half = shard.size // 2
    return shard.with_extra_info(microbatches=[list(range(half)), list(range(half, shard.size))], dp_rank=dp_rank)


# -- comparison ------------------------------------------------------------------------------------
def _bytes_of(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes()) + repr((t.dtype, tuple(t.shape))).encode()


def fingerprint(td: TensorDict) -> str:
    """Hash of names, dtypes, shapes and bytes of every field (nested: values + offsets)."""
    h = hashlib.sha256()
    for name in td.keys():
        v = td.get(name)
        h.update(str(name).encode())
        if isinstance(v, NonTensorStack):
            h.update(pickle.dumps(v.tolist()))
        elif v.is_nested:
            h.update(_bytes_of(v.values()) + _bytes_of(v.offsets()))
        else:
            h.update(_bytes_of(v))
    return h.hexdigest()


def reference_read(client: DataPlaneClient, meta: KVBatchMeta, layout: Layout, fields: Sequence[str]) -> TensorDict:
    pad = meta.extra_info.get("pad_to_length") if layout == "padded" else None
    return client.kv_batch_get(meta, select_fields=list(fields), layout=layout, pad_values=PAD, pad_to_length=pad)


# -- workers used in the tests ---------------------------------------------------------------------
class GroupWorker(DataPlaneWorkerMixin):
    def __init__(self, group: Any) -> None:
        self._group = group

    def replica_group(self) -> Any:
        return self._group


class MeshWorker(DeviceMeshReplicaMixin, DataPlaneWorkerMixin):
    def __init__(self, mesh: Any) -> None:
        self.device_mesh = mesh


class FailingGets(DataPlaneClient):
    """Fault injection: a client whose reads raise ``error``; everything else goes to ``inner``."""

    def __init__(self, inner: DataPlaneClient, error: Exception) -> None:
        self.inner, self.error = inner, error

    @property
    def capabilities(self) -> dataplane.Capabilities:
        return self.inner.capabilities

    def kv_batch_put(self, keys: Any, fields: Any, *, partition_id: str, tags: Any = None) -> KVBatchMeta:
        return self.inner.kv_batch_put(keys, fields, partition_id=partition_id, tags=tags)

    def kv_batch_get(self, keys_or_meta: Any, **kwargs: Any) -> TensorDict:
        raise self.error

    def kv_clear(self, keys: Any = None, *, partition_id: str) -> None:
        self.inner.kv_clear(keys, partition_id=partition_id)

    def kv_list(self, partition_id: str | None = None) -> Any:
        return self.inner.kv_list(partition_id)

    def close(self) -> None:
        self.inner.close()


# -- scenarios, run on every rank ------------------------------------------------------------------
class Ctx:
    def __init__(self, rank: int, world: int, backend: str) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        self.groups = [dist.new_group(list(range(s, s + GROUP))) for s in range(0, world, GROUP)]
        self.group = self.groups[rank // GROUP]
        self.dp_rank, self.dp_size = rank // GROUP, world // GROUP
        self.leader = rank % GROUP == 0
        self.client, self.meta = filled_client()
        self.shard = shard_of(self.meta, self.dp_rank, self.dp_size)


def _timed(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def scenario_policies(ctx: Ctx) -> dict[str, Any]:
    w = GroupWorker(ctx.group)
    w.setup_data_plane(ctx.client)
    pooled = GroupWorker(ctx.group)  # reads into the pinned pool (on gloo: the pool's CPU path)
    pooled.data_plane_pinned = "always"
    pooled.setup_data_plane(ctx.client)
    out: dict[str, Any] = {}
    for layout in ("jagged", "padded"):
        ref = fingerprint(reference_read(ctx.client, ctx.shard, layout, FIELDS))
        for policy in ("independent", "leader_broadcast", "auto"):
            for device, worker in ((None, w), (ctx.device, w), (ctx.device, pooled)):
                td = worker.fetch(
                    ctx.shard, select_fields=FIELDS, layout=layout, pad_values=PAD, policy=policy, device=device
                )
                stats = worker.last_fetch_stats
                assert stats is not None
                ids = td.get("ids")
                how = "None" if device is None else "dev" if worker is w else "pooled"
                out[f"{layout}/{policy}/{how}"] = {
                    "same": fingerprint(td) == ref,
                    "fp": fingerprint(td),
                    "stats": stats.to_dict(),
                    "device": str((ids.values() if ids.is_nested else ids).device),
                }
    return out


def scenario_failures(ctx: Ctx) -> dict[str, Any]:
    w = GroupWorker(ctx.group)
    w.setup_data_plane(ctx.client)
    missing = KVBatchMeta(partition_id=PARTITION, keys=(*ctx.shard.keys, "no-such-key"))
    out = {"missing_key": _timed(lambda: w.fetch(missing, select_fields=FIELDS, policy="leader_broadcast"))}
    # The group must still be in step after a failed round.
    out["after_missing"] = _timed(lambda: w.fetch(ctx.shard, select_fields=FIELDS, policy="leader_broadcast"))
    if ctx.leader:
        w.setup_data_plane(FailingGets(ctx.client, RuntimeError("injected get failure")))
    out["wrapper"] = _timed(lambda: w.fetch(ctx.shard, select_fields=FIELDS, policy="leader_broadcast"))
    w.setup_data_plane(ctx.client)
    out["after_wrapper"] = _timed(lambda: w.fetch(ctx.shard, select_fields=FIELDS, policy="auto"))
    fields = FIELDS if ctx.leader else FIELDS[:2]  # a sibling asking for other fields than its leader
    out["mismatch"] = _timed(lambda: w.fetch(ctx.shard, select_fields=fields, policy="leader_broadcast"))
    out["after_mismatch"] = _timed(lambda: w.fetch(ctx.shard, select_fields=FIELDS, policy="leader_broadcast"))
    return out


def scenario_writeback(ctx: Ctx) -> dict[str, Any]:
    events: list[CallEvent] = []
    observed = ObservedClient(ctx.client, callback=events.append)
    w = GroupWorker(ctx.group)
    w.setup_data_plane(observed)
    td = w.fetch(ctx.shard, select_fields=["logp", "adv"], policy="auto", device=ctx.device)
    old = td.get("logp").float() * 2  # padded [B, pad_to_length]: packed back to jagged
    written = w.write_back(ctx.shard, {"old_logp": old, "score": td.get("adv") + 1})
    puts = [e for e in events if e.op == "kv_batch_put"]
    out: dict[str, Any] = {
        "leader": w.is_writeback_leader(),
        "puts": len(puts),
        "put_keys": sum(e.n_keys for e in puts),
        "written_keys": [] if written is None else list(written.keys),
        "fields": None if written is None else list(written.fields),
    }
    back = _timed(lambda: ctx.client.kv_batch_get(ctx.shard, select_fields=["old_logp"]))
    out["read_back"] = back
    if back["error"] is None:
        nested = ctx.client.kv_batch_get(ctx.shard, select_fields=["old_logp"]).get("old_logp")
        lens = (nested.offsets()[1:] - nested.offsets()[:-1]).tolist()
        out["lengths_ok"] = lens == list(ctx.shard.sequence_lengths or ())
    return out


def scenario_mesh(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    kind = ctx.device.type
    out: dict[str, Any] = {}
    for shape in ((ctx.world // GROUP, 1, GROUP), (1, GROUP, ctx.world // GROUP)):
        mesh = init_device_mesh(kind, shape, mesh_dim_names=("dp", "cp", "tp"))
        group = replica_group_from_mesh(mesh)
        out[str(shape)] = {
            "ranks": None if group is None else sorted(dist.get_process_group_ranks(group)),
            "leader": is_leader_from_mesh(mesh),
        }
        if shape[0] > 1:
            w = MeshWorker(mesh)
            w.setup_data_plane(ctx.client)
            shard = shard_of(ctx.meta, int(mesh.get_local_rank("dp")), shape[0])
            td = w.fetch(shard, select_fields=FIELDS, policy="auto", pad_values=PAD)
            out[str(shape)]["same"] = fingerprint(td) == fingerprint(
                reference_read(ctx.client, shard, "padded", FIELDS)
            )
            out[str(shape)]["policy"] = w.last_fetch_stats.policy if w.last_fetch_stats else None
    return out


def scenario_timeout(ctx: Ctx) -> dict[str, Any]:
    """Siblings fetch while their leader never joins: they must raise within the timeout (run last)."""
    fresh = [dist.new_group(list(range(s, s + GROUP))) for s in range(0, ctx.world, GROUP)]
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=fresh[ctx.rank // GROUP])  # communicators up
    if ctx.leader:
        time.sleep(4.0)  # alive but absent (a dead leader is detected at once: BackendUnavailable)
        return {"skipped": True}
    w = GroupWorker(fresh[ctx.rank // GROUP])
    w.setup_data_plane(ctx.client)
    return _timed(lambda: w.fetch(ctx.shard, select_fields=FIELDS, policy="leader_broadcast", timeout_s=1.5))


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "policies": scenario_policies,
    "failures": scenario_failures,
    "writeback": scenario_writeback,
    "mesh": scenario_mesh,
    "timeout": scenario_timeout,
}


def _scenarios(rank: int, world: int, backend: str, names: Sequence[str]) -> dict[str, Any]:
    ctx = Ctx(rank, world, backend)
    return {name: SCENARIOS[name](ctx) for name in names}


def run_group(world: int, backend: str, names: Sequence[str], timeout_s: float = 150.0) -> dict[int, dict[str, Any]]:
    """Start ``world`` ranks running the named scenarios; return each rank's results. Gloo ranks are
    forked from the forkserver (tests/conftest.py); NCCL ranks are spawned, each a fresh interpreter
    that starts CUDA (:func:`dataplane.testing.ranks.run_ranks`)."""
    got = run_ranks(_scenarios, world, backend, names, backend=backend, timeout_s=timeout_s)  # type: ignore[arg-type]
    return dict(enumerate(got))


# -- assertions shared with the GPU tests ----------------------------------------------------------
def check_policies(got: Mapping[int, Mapping[str, Any]], world: int) -> None:
    for rank, out in got.items():
        for case, r in out["policies"].items():
            assert r["same"], f"rank {rank} {case}: differs from an independent read"
            st = r["stats"]
            if "/independent/" in case:
                assert st["role"] == "reader" and st["store_bytes"] > 0 and st["broadcast_bytes"] == 0
            else:
                assert st["policy"] == "leader_broadcast", case
                if rank % GROUP == 0:
                    assert st["role"] == "leader" and st["store_bytes"] > 0, case
                else:
                    assert st["role"] == "sibling" and st["store_bytes"] == 0 and st["broadcast_bytes"] > 0, case
    for start in range(0, world, GROUP):
        members = range(start, start + GROUP)
        for case in got[start]["policies"]:
            assert len({got[r]["policies"][case]["fp"] for r in members}) == 1, case


def check_failures(got: Mapping[int, Mapping[str, Any]], limit_s: float) -> None:
    for rank, out in got.items():
        f = out["failures"]
        assert f["missing_key"]["error"] == "KeyNotFound", (rank, f["missing_key"])
        assert "no-such-key" in f["missing_key"]["message"] and "leader" in f["missing_key"]["message"]
        assert f["wrapper"]["error"] == "DataPlaneError", (rank, f["wrapper"])
        assert "RuntimeError: injected get failure" in f["wrapper"]["message"]
        assert f["mismatch"]["error"] == "InvalidArgument", (rank, f["mismatch"])
        for case in ("missing_key", "wrapper", "mismatch"):
            assert f[case]["seconds"] < limit_s, (rank, case, f[case])
        for case in ("after_missing", "after_wrapper", "after_mismatch"):
            assert f[case]["error"] is None, (rank, case, f[case])
    for start in range(0, len(got), GROUP):
        msgs = {got[r]["failures"]["missing_key"]["message"] for r in range(start, start + GROUP)}
        assert len(msgs) == 1, msgs


def check_writeback(got: Mapping[int, Mapping[str, Any]], total_rows: int) -> None:
    written = Counter(k for out in got.values() for k in out["writeback"]["written_keys"])
    assert len(written) == total_rows and set(written.values()) == {1}, written
    assert sum(out["writeback"]["puts"] for out in got.values()) == len(got) // GROUP
    assert sum(out["writeback"]["put_keys"] for out in got.values()) == total_rows
    for rank, out in got.items():
        wb = out["writeback"]
        assert wb["leader"] == (rank % GROUP == 0)
        if wb["leader"]:
            assert wb["puts"] == 1 and wb["read_back"]["error"] is None and wb["lengths_ok"], wb
            assert wb["fields"][-2:] == ["old_logp", "score"]
        else:
            assert wb["puts"] == 0 and wb["read_back"]["error"] == "KeyNotFound", wb


def check_mesh(got: Mapping[int, Mapping[str, Any]], world: int) -> None:
    for rank, out in got.items():
        by_tp = out["mesh"][str((world // GROUP, 1, GROUP))]
        start = rank - rank % GROUP
        assert by_tp["ranks"] == list(range(start, start + GROUP)) and by_tp["leader"] == (rank % GROUP == 0)
        if world // GROUP > 1:
            assert by_tp["same"] and by_tp["policy"] == "leader_broadcast"
        flat = out["mesh"][str((1, GROUP, world // GROUP))]
        assert flat["ranks"] == list(range(world)) and flat["leader"] == (rank == 0)


def check_timeout(got: Mapping[int, Mapping[str, Any]]) -> None:
    for rank, out in got.items():
        t = out["timeout"]
        if rank % GROUP:
            assert t["error"] == "DataPlaneTimeout" and 1.4 < t["seconds"] < 10, t


# -- multi-process tests ---------------------------------------------------------------------------
WORLD = 4


@pytest.fixture(scope="module")
def gloo_results() -> dict[int, dict[str, Any]]:
    return run_group(WORLD, "gloo", list(SCENARIOS))


@pytest.mark.multiprocess
def test_every_policy_matches_an_independent_read(gloo_results: dict[int, dict[str, Any]]) -> None:
    check_policies(gloo_results, WORLD)


@pytest.mark.multiprocess
def test_failing_leader_raises_on_every_rank(gloo_results: dict[int, dict[str, Any]]) -> None:
    check_failures(gloo_results, limit_s=10.0)


@pytest.mark.multiprocess
def test_write_back_one_put_per_key(gloo_results: dict[int, dict[str, Any]]) -> None:
    check_writeback(gloo_results, total_rows=12)


@pytest.mark.multiprocess
def test_replica_groups_from_device_mesh(gloo_results: dict[int, dict[str, Any]]) -> None:
    check_mesh(gloo_results, WORLD)


@pytest.mark.multiprocess
def test_absent_leader_times_out(gloo_results: dict[int, dict[str, Any]]) -> None:
    check_timeout(gloo_results)


# -- single-process tests --------------------------------------------------------------------------
class Plain(DataPlaneWorkerMixin):
    pass


@pytest.fixture
def worker() -> Any:
    w = Plain()
    client, meta = filled_client()
    w.setup_data_plane(client)
    yield w, client, meta
    client.close()


@pytest.mark.parametrize("layout", ["jagged", "padded"])
def test_dp_only_fetch_equals_client_read(worker: Any, layout: Layout) -> None:
    w, client, meta = worker
    for policy in ("auto", "independent", "leader_broadcast"):  # no group: all read independently
        td = w.fetch(meta, select_fields=FIELDS, layout=layout, pad_values=PAD, policy=policy)
        assert fingerprint(td) == fingerprint(reference_read(client, meta, layout, FIELDS))
        assert list(td.keys()) == FIELDS
        assert w.last_fetch_stats.policy == "independent" and w.last_fetch_stats.role == "reader"
    if layout == "padded":
        assert td.get("ids").shape[1] == meta.extra_info["pad_to_length"] == w.last_fetch_stats.pad_width
        wider = w.fetch(meta, select_fields="ids", pad_to_length=64, pad_to_multiple=48)
        assert wider.get("ids").shape[1] == 96


def test_fetch_validates_arguments(worker: Any) -> None:
    w, _, meta = worker
    with pytest.raises(InvalidArgument, match="select_fields"):
        w.fetch(meta, select_fields=[])
    with pytest.raises(InvalidArgument, match="policy"):
        w.fetch(meta, select_fields="ids", policy=cast(Any, "broadcast"))
    with pytest.raises(InvalidArgument, match="layout"):
        w.fetch(meta, select_fields="ids", layout=cast(Any, "dense"))
    with pytest.raises(InvalidArgument, match="pad_to_length"):
        w.fetch(meta.with_extra_info(pad_to_length=2), select_fields="ids")
    with pytest.raises(DataPlaneError, match="setup_data_plane"):
        Plain().fetch(meta, select_fields="ids")


def test_setup_from_url_owns_the_client() -> None:
    w = Plain()
    client = w.setup_data_plane("memory://")
    w.close_data_plane()
    assert client.closed  # type: ignore[attr-defined]
    other = dataplane.connect()
    w.setup_data_plane(other)
    w.close_data_plane()
    assert not other.closed  # type: ignore[attr-defined]
    with pytest.raises(SchemaError):
        w.setup_data_plane(42)  # type: ignore[arg-type]


def test_wire_round_trip_all_kinds() -> None:
    client, meta = filled_client()
    jagged = client.kv_batch_get(meta, select_fields=FIELDS)
    cols = columns_from_jagged(jagged, FIELDS)
    desc = plan_buffers(cols, rows=meta.size, digest=batch_digest(meta, FIELDS))
    assert [d for d, _ in desc.buffers] == ["int64", "bfloat16", "bool", "float32", "uint8"]
    assert Descriptor.from_bytes(desc.to_bytes()) == desc
    back = unstage(desc, stage(cols, desc, torch.device("cpu")))
    for name, col in cols.items():
        assert torch.equal(back[name].values.view(torch.uint8), col.values.view(torch.uint8)), name
        assert (col.offsets is None) == (back[name].offsets is None)
        got = back[name].offsets
        if col.offsets is not None:
            assert got is not None and torch.equal(got, col.offsets)
    client.close()


def test_error_descriptor_and_reconstruction() -> None:
    info = ErrorInfo(type="KeyNotFound", message="gone", rank=3)
    desc = Descriptor(rows=2, digest="x", error=info)
    assert Descriptor.from_bytes(desc.to_bytes()).error == info
    err = error_from_info(info)
    assert isinstance(err, KeyNotFound) and isinstance(err, KeyError) and "global rank 3" in str(err)
    other = error_from_info(ErrorInfo(type="OSError", message="disk", rank=0))
    assert type(other) is DataPlaneError and str(other).startswith("OSError: disk")
    assert type(error_from_info(ErrorInfo(type="TimeoutError", message="t", rank=0))) is DataPlaneError
    with pytest.raises(DataPlaneError, match="protocol version"):
        Descriptor.from_bytes(b"\x81\xa1v\x63")


def test_fetch_stats_pickle_and_dict() -> None:
    s = FetchStats(policy="leader_broadcast", role="sibling", group_size=2, rows=3, fields=("a",), broadcast_bytes=9)
    assert pickle.loads(pickle.dumps(s)) == s == FetchStats.from_dict(s.to_dict())


class NotLeader(DataPlaneWorkerMixin):
    def is_writeback_leader(self) -> bool:
        return False


def test_write_back_packs_padded_token_fields(worker: Any) -> None:
    w, client, meta = worker
    td = w.fetch(meta, select_fields=["logp"])
    written = w.write_back(meta, {"old": td.get("logp").float(), "r": torch.ones(meta.size)})
    assert written is not None and written.fields[-2:] == ("old", "r")
    back = client.kv_batch_get(meta, select_fields=["old", "logp", "r"])
    assert torch.equal(back.get("old").offsets(), back.get("logp").offsets())
    assert torch.equal(back.get("old").values(), back.get("logp").values().float())
    assert back.get("r").shape == (meta.size,)
    # auto leaves per-row [B, k] fields alone; explicit names pack any width >= the longest row
    w.write_back(meta, {"topk": torch.zeros(meta.size, 4)})
    assert client.kv_batch_get(meta, select_fields="topk").get("topk").shape == (meta.size, 4)
    longest = max(meta.sequence_lengths)
    w.write_back(meta, {"v": torch.zeros(meta.size, longest + 3)}, token_fields=["v"])
    assert client.kv_batch_get(meta, select_fields="v").get("v").is_nested


def test_write_back_checks_sizes(worker: Any) -> None:
    w, client, meta = worker
    with pytest.raises(InvalidArgument, match="rows but the meta has"):
        w.write_back(meta, {"x": torch.zeros(meta.size + 1)})
    wrong = [torch.zeros(n + 1) for n in meta.sequence_lengths]
    with pytest.raises(InvalidArgument, match="sequence_lengths says"):
        w.write_back(meta, {"x": torch.nested.as_nested_tensor(wrong, layout=torch.jagged)})
    w.write_back(meta, {"x": torch.nested.as_nested_tensor(wrong, layout=torch.jagged)}, check_lengths=False)
    with pytest.raises(InvalidArgument, match="wide"):
        w.write_back(meta, {"y": torch.zeros(meta.size, 2)}, token_fields=["y"])
    with pytest.raises(InvalidArgument, match="not being written"):
        w.write_back(meta, {"y": torch.zeros(meta.size)}, token_fields=["z"])
    with pytest.raises(SchemaError):
        w.write_back(meta, {"y": torch.tensor(1.0)})
    assert "y" not in client.kv_batch_get(meta, select_fields="x").keys()


def test_write_back_skips_non_leaders() -> None:
    events: list[CallEvent] = []
    w = NotLeader()
    client, meta = filled_client()
    w.setup_data_plane(ObservedClient(client, callback=events.append))
    assert w.write_back(meta, {"x": torch.zeros(meta.size)}) is None
    assert events == []


def test_iter_microbatches_follows_the_plan(worker: Any) -> None:
    w, _, meta = worker
    shard = shard_of(meta, 0, 2).with_extra_info(microbatches=[[0, 2], [1, 3, 4, 5], []])
    td = w.fetch(shard, select_fields=FIELDS, layout="jagged")
    mbs = list(w.iter_microbatches(td, shard))
    assert [mb.batch_size[0] for mb in mbs] == [2, 4, 0]
    msgs = td.get("msgs").tolist()
    assert mbs[0].get("msgs").tolist() == [msgs[0], msgs[2]]
    assert torch.equal(mbs[1].get("ids").values(), torch.cat([td.get("ids")[i] for i in (1, 3, 4, 5)]))
    plain = shard.with_extra_info(microbatches=None)
    assert [mb.batch_size[0] for mb in iter_microbatches(td, plain, micro_batch_size=4)] == [4, 2]
    with pytest.raises(InvalidArgument, match="another shard"):
        list(iter_microbatches(td, shard.with_extra_info(microbatches=[[9]])))
    with pytest.raises(InvalidArgument, match="rows but the meta"):
        list(iter_microbatches(td, meta))
