"""The shared-memory arenas of a Mooncake client attached to a real client (``dataplane.adapters.mooncake._shm``): carving,
coalescing, and reuse across clients of one process. The allocator is tested with plain memory and
recorded registration calls; the real shared-memory path runs in the adapter, conformance and
multi-process suites (``shm`` parameter)."""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import dataplane
from dataplane._host import mooncake_master, processes
from dataplane.adapters.mooncake import MooncakeConfig, _servers, _shm
from dataplane.adapters.mooncake._shm import Arena, ShmArenas
from dataplane.errors import BackendUnavailable, CapacityExceeded, InvalidArgument
from dataplane.testing.strategies import bit_exact


def test_arena_carves_first_fit_and_merges_holes() -> None:
    a = Arena(0, 100, np.zeros(100, np.uint8), [[0, 100]])
    x, y, z = a.carve(30), a.carve(30), a.carve(30)
    assert (x, y, z) == (0, 30, 60) and a.carve(20) is None
    a.give_back(30)
    assert a.carve(40) is None and a.carve(30) == 30  # the hole is reused exactly
    a.give_back(0)
    a.give_back(30)  # merges with the hole before it
    assert a.free == [[0, 60], [90, 10]]
    a.give_back(60)  # and with both neighbours: one hole again
    assert a.free == [[0, 100]] and not a.taken


class _FakeMooncake:
    """Plain memory standing in for ``alloc_from_mem_pool``; records (un)registration."""

    def __init__(self, fail_unregister: bool = False) -> None:
        self.keep: list[np.ndarray] = []
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.fail_unregister = fail_unregister

    def make(self, n: int) -> int:
        self.keep.append(np.zeros(n, np.uint8))
        return int(self.keep[-1].ctypes.data)

    def register(self, ptr: int, n: int) -> None:
        self.registered.append(ptr)

    def unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return -900 if self.fail_unregister else 0

    def arenas(self) -> ShmArenas:
        return ShmArenas(self.make, self.register, self.unregister)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_shm, "CHUNK", 1 << 20)
    monkeypatch.setattr(_shm, "_IDLE", [])
    monkeypatch.setattr(_shm, "_ORPHANS", [])
    monkeypatch.setattr(_shm, "_LIVE", [])
    yield


@pytest.mark.usefixtures("small_chunks")
def test_arenas_are_registered_once_and_reused_by_the_next_client() -> None:
    fake = _FakeMooncake()
    first = fake.arenas()
    a, b = first.alloc(300 << 10), first.alloc(300 << 10)
    big = first.alloc(3 << 20)  # larger than a chunk: a region of its own size
    assert len(fake.registered) == 2 and b.ctypes.data - a.ctypes.data == 300 << 10
    assert big.nbytes == 3 << 20 and len(first.spans()) == 2
    first.free(big)
    first.release()  # the client closes while a and b are still lent out
    assert sorted(fake.unregistered) == sorted(fake.registered)
    assert len(_shm._IDLE) == 1 and len(_shm._ORPHANS) == 1
    second = fake.arenas()
    again = second.alloc(1 << 20)  # the idle 3 MiB region, registered with the new client
    assert len(fake.keep) == 2 and again.ctypes.data == big.ctypes.data and len(fake.registered) == 3
    first.free(a)
    first.free(b)  # the orphan's last piece came back: idle again, for any later client
    assert not _shm._ORPHANS and len(_shm._IDLE) == 1


@pytest.mark.usefixtures("small_chunks")
def test_a_region_that_could_not_be_unregistered_is_never_reused() -> None:
    fake = _FakeMooncake(fail_unregister=True)  # its real client died
    first = fake.arenas()
    first.free(first.alloc(100))
    first.release()
    assert not _shm._IDLE
    fake.arenas().alloc(100)
    assert len(fake.keep) == 2  # a new region, not the poisoned one


@pytest.mark.usefixtures("small_chunks")
def test_a_failed_registration_raises_and_keeps_the_region() -> None:
    fake = _FakeMooncake()

    def refuse(ptr: int, n: int) -> None:
        raise BackendUnavailable("real client gone")

    arenas = ShmArenas(fake.make, refuse, fake.unregister)
    with pytest.raises(BackendUnavailable):
        arenas.alloc(100)
    assert len(_shm._IDLE) == 1 and not arenas.spans()


def test_shared_memory_options() -> None:
    assert MooncakeConfig.from_url("mooncake://local").shm is True
    assert MooncakeConfig.from_url("mooncake://local?shm=false").shm is False
    cfg = MooncakeConfig.from_url("mooncake://10.0.0.1:50051?real_client=127.0.0.1:50052")
    assert cfg.real_client == "127.0.0.1:50052"
    for bad in (
        "mooncake://local?shm=maybe",
        "mooncake://local?real_client=127.0.0.1:50052",  # local starts its own
        "mooncake://10.0.0.1:50051?real_client=nohostport",
        "mooncake://local?client_segment_bytes=1GiB",  # an attached client lends nothing
    ):
        with pytest.raises(InvalidArgument):
            MooncakeConfig.from_url(bad)
    assert MooncakeConfig.from_url("mooncake://local?shm=false&client_segment_bytes=1GiB").client_segment_bytes


@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_a_later_client_of_this_process_reuses_the_shared_memory_of_a_closed_one() -> None:
    def round_trip() -> list[tuple[int, int]]:
        with dataplane.connect("mooncake://local?segment_bytes=64MiB") as c:
            x = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
            meta = c.kv_batch_put(["a", "b"], {"x": x.view(2, -1)}, partition_id="p")
            got = c.kv_batch_get(meta, select_fields="x")["x"]
            assert bit_exact(got.reshape(-1), x)
            spans = c.store.handle.shm.spans()  # type: ignore[attr-defined]
            del got
            gc.collect()
            return spans

    first = round_trip()
    assert first and all(size >= _shm.CHUNK for _, size in first)
    idle = {a.base for a in _shm._IDLE}
    assert {base for base, _ in first} <= idle  # every piece came back: free for the next client
    # an idle region, registered with the new client's real client: no new shared memory
    second = {base for base, _ in round_trip()}
    assert second and second <= idle


@pytest.mark.usefixtures("small_chunks")
def test_a_piece_freed_while_the_lock_is_held_is_taken_back_later() -> None:
    fake = _FakeMooncake()
    arenas = fake.arenas()
    piece = arenas.alloc(100)
    with _shm._LOCK:  # as when the garbage collector finalizes a tensor inside alloc
        arenas.free(piece)  # must not wait for the lock
        assert len(_shm._RETURNED) == 1
    assert arenas.alloc(100).ctypes.data == piece.ctypes.data  # taken back first, then reused
    assert not _shm._RETURNED


def test_the_real_client_binary_is_found_in_the_wheel_or_by_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAPLANE_MOONCAKE_CLIENT", "/opt/mc/mooncake_client")
    assert _servers.find_real_client_binary() == "/opt/mc/mooncake_client"
    monkeypatch.delenv("DATAPLANE_MOONCAKE_CLIENT")
    if importlib.util.find_spec("mooncake") is None:
        with pytest.raises(RuntimeError, match="DATAPLANE_MOONCAKE_CLIENT"):
            _servers.find_real_client_binary()
        return
    path = Path(_servers.find_real_client_binary())
    assert path.name == "mooncake_client" and os.access(path, os.X_OK)


@pytest.mark.usefixtures("small_chunks")
def test_shared_memory_that_cannot_be_mapped_is_a_capacity_error() -> None:
    fake = _FakeMooncake()
    arenas = ShmArenas(lambda n: 0, fake.register, fake.unregister)  # alloc_from_mem_pool failed
    with pytest.raises(CapacityExceeded, match="shm=false"):
        arenas.alloc(100)
    assert not fake.registered


def test_a_real_client_that_exits_at_start_is_reported_with_its_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAPLANE_MOONCAKE_CLIENT", "/bin/false")  # exits 1 at once, like a port clash
    master = mooncake_master.MasterHandle(host="127.0.0.1", rpc_port=1, metrics_port=1, pid=os.getpid())
    with pytest.raises(RuntimeError, match="exited rc=1"):
        _servers.start_real_client(master, segment_bytes=1 << 20, attempts=2)
    assert not [h for h in processes._LIVE if isinstance(h, _servers.StoreServerHandle) and h.alive()]
