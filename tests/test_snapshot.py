"""Core snapshots (``dataplane.snapshot``) beyond the conformance suite's round trips: a load into
another backend, saves killed (SIGKILL) at every filesystem step and at random instants, damaged and
foreign directories, and rows that change while a save reads them."""

from __future__ import annotations

import doctest
import fcntl
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataplane
import dataplane.snapshot
from dataplane import DataPlaneClient, InvalidArgument, SnapshotConflict, SnapshotError, SnapshotNotFound
from dataplane.snapshot import load_snapshot, save_snapshot, snapshot_info
from dataplane.testing._conformance_snapshot import fill_every_kind, partition_state, same_state

STEPS = ("fsync", "rename", "replace", "unlink", "rmdir")  # the filesystem steps a save takes, in os
PARTS = ("train", "val")


def test_doctests() -> None:
    result = doctest.testmod(dataplane.snapshot)
    assert result.attempted > 0 and result.failed == 0


# -- rows of one generation: what a save at generation g writes, to check a load against ---------
def fill_generation(client: DataPlaneClient, gen: int, rows: int = 24, width: int = 256) -> None:
    """Deterministic rows of generation ``gen`` in ``train`` and ``val`` (replacing what they hold)."""
    for pid in PARTS:
        client.kv_clear(partition_id=pid)
    g = torch.Generator().manual_seed(gen)
    keys = [f"k{i}" for i in range(rows)]
    lens = torch.randint(0, 40, (rows,), generator=g).tolist()
    fields = {
        "x": torch.randn(rows, width, generator=g),
        "tok": torch.nested.as_nested_tensor(
            [torch.randint(0, 999, (n,), generator=g) for n in lens], layout=torch.jagged
        ),
        "msg": [{"gen": gen, "i": i} for i in range(rows)],
    }
    client.kv_batch_put(["marker"], None, partition_id="train", tags=[{"gen": gen}])
    client.kv_batch_put(keys, fields, partition_id="train", tags=[{"gen": gen, "i": i} for i in range(rows)])
    client.kv_batch_put(keys[::3], {"adv": torch.randn(len(keys[::3]), generator=g)}, partition_id="train")
    client.kv_batch_put(["v"], {"r": torch.tensor([float(gen)])}, partition_id="val")


def generation_state(gen: int) -> dict[str, Any]:
    with dataplane.connect("memory://") as c:
        fill_generation(c, gen)
        return {pid: partition_state(c, pid) for pid in PARTS}


def loaded_state(path: Path) -> tuple[Any, dict[str, Any]]:
    with dataplane.connect("memory://") as c:
        info = load_snapshot(c, path)
        assert set(info.partitions) == set(PARTS) and info.partitions["train"] == 25
        return info.metadata, {pid: partition_state(c, pid) for pid in PARTS}


def save_generation(path: Path, gen: int) -> None:
    with dataplane.connect("memory://") as c:
        fill_generation(c, gen)
        save_snapshot(c, path, metadata={"gen": gen}, rows_per_file=10)


# -- processes killed while they save (forkserver children: tests/conftest.py preloads them) ------
def _kill_at_step(n: int) -> None:
    """SIGKILL this process when it is about to take its n-th filesystem step (0-based) of ``STEPS``."""
    taken = [0]

    def stepping(real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if taken[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            taken[0] += 1
            return real(*args, **kwargs)

        return step

    for name in STEPS:
        setattr(os, name, stepping(getattr(os, name)))


def _save_killed_at_step(path: str, gen: int, n: int) -> None:
    with dataplane.connect("memory://") as c:
        fill_generation(c, gen)
        _kill_at_step(n)
        save_snapshot(c, path, metadata={"gen": gen}, rows_per_file=10)


def _save_forever(path: str, first: int, started: Any) -> None:
    with dataplane.connect("memory://") as c:
        for gen in range(first, first + 10_000):
            fill_generation(c, gen)
            started.set()
            save_snapshot(c, path, metadata={"gen": gen}, rows_per_file=10)


def _run_child(target: Callable[..., None], *args: Any, kill_after: float | None = None) -> int | None:
    ctx = multiprocessing.get_context("forkserver")
    started = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, started) if kill_after is not None else args)
    proc.start()
    try:
        if kill_after is not None:
            assert started.wait(timeout=60), "the saving process did not start"
            time.sleep(kill_after)
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(timeout=60)
        assert not proc.is_alive(), "the saving process did not end"
        return proc.exitcode
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            proc.join(timeout=10)


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot directory holding generation 1, after an earlier save of generation 0."""
    base = tmp_path_factory.mktemp("base") / "snap"
    save_generation(base, 0)
    save_generation(base, 1)
    return base


def _steps_of_a_save(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    taken: list[str] = []
    for name in STEPS:
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _n=name, _r=real, **k: (taken.append(_n), _r(*a, **k))[1])
    try:
        save_generation(path, 2)
    finally:
        monkeypatch.undo()
    return taken


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_save_killed_at_any_filesystem_step_leaves_one_whole_snapshot(
    saved_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of generation 2 over generation 1, SIGKILLed before each of its filesystem steps in turn
    (fsync, rename, replace, unlink, rmdir): generation 1 loads whole until the step that replaces
    CURRENT has run, generation 2 whole from then on, and the next save cleans up what was left."""
    steps = _steps_of_a_save(shutil.copytree(saved_base, tmp_path / "probe"), monkeypatch)
    switch = steps.index("replace")
    assert steps.count("replace") == 1 and steps.count("rename") == 1 and len(steps) > switch + 2
    old, new = generation_state(1), generation_state(2)
    for n in range(len(steps) + 1):
        work = shutil.copytree(saved_base, tmp_path / f"kill{n}")
        code = _run_child(_save_killed_at_step, str(work), 2, n)
        assert code == (0 if n == len(steps) else -signal.SIGKILL), (n, code)
        metadata, state = loaded_state(work)
        want, gen = (old, 1) if n <= switch else (new, 2)
        assert metadata == {"gen": gen}, (n, steps[n - 1 : n + 1])
        for pid in PARTS:
            same_state(state[pid], want[pid])
        save_generation(work, 3)  # what a killed save left behind is no obstacle, and is cleared
        assert sorted(os.listdir(work)) == [".lock", "CURRENT", snapshot_info(work).path.name]
        shutil.rmtree(work)


def _kills_at_random_instants(saved_base: Path, tmp_path: Path, kills: int, seed: int) -> int:
    """Returns how many kills left a save half-written (a ``.tmp-*`` directory behind)."""
    rng = random.Random(seed)
    work = shutil.copytree(saved_base, tmp_path / "random")
    states = {g: generation_state(g) for g in range(1, 4)}
    first, torn = 2, 0
    for _ in range(kills):
        code = _run_child(_save_forever, str(work), first, kill_after=rng.uniform(0.0, 0.4))
        assert code == -signal.SIGKILL
        torn += any(name.startswith(".tmp-") for name in os.listdir(work))
        metadata, state = loaded_state(work)
        gen = metadata["gen"]
        assert first - 1 <= gen, (gen, first)  # the previous snapshot, or one the child finished
        want = states.get(gen) or states.setdefault(gen, generation_state(gen))
        for pid in PARTS:
            same_state(state[pid], want[pid])
        first = gen + 1
    return torn


@pytest.mark.multiprocess
def test_saves_killed_at_random_instants_leave_the_last_whole_snapshot(saved_base: Path, tmp_path: Path) -> None:
    """A process saving generation after generation, SIGKILLed at a random instant: the directory
    loads one whole generation, the last one it finished (or the one before the child started)."""
    _kills_at_random_instants(saved_base, tmp_path, kills=6, seed=1)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.multiprocess
def test_saves_killed_at_random_instants_soak(saved_base: Path, tmp_path: Path) -> None:
    torn = _kills_at_random_instants(saved_base, tmp_path, kills=150, seed=int(time.time()))
    assert torn > 10, f"only {torn} of 150 kills landed inside a save's writes"


# -- into another backend ----------------------------------------------------------------------
@pytest.mark.mooncake
def test_mooncake_rows_load_into_memory_and_back(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="Mooncake is not installed (pip install 'dataplane[mooncake]')")
    with dataplane.connect("mooncake://local?segment_bytes=256MiB&timeout_s=120") as mc:
        fill_every_kind(mc, "rows")
        mc.kv_batch_put(["m"], {"x": torch.ones(2, 3)[:1]}, partition_id="other", tags=[{"t": 1}])
        want = {pid: partition_state(mc, pid) for pid in ("rows", "other")}
        info = save_snapshot(mc, tmp_path / "snap")
        assert info.backend == "mooncake" and info.partitions == {"rows": 7, "other": 1}
        with dataplane.connect("memory://") as mem:
            assert load_snapshot(mem, tmp_path / "snap").partitions == info.partitions
            for pid, state in want.items():
                same_state(partition_state(mem, pid), state)
            mem.kv_batch_put(["n"], {"x": torch.zeros(1, 3)}, partition_id="other", tags=[{}])
            save_snapshot(mem, tmp_path / "back", ["other"])
        mc.kv_clear(partition_id="other")
        load_snapshot(mc, tmp_path / "back")
        assert list(mc.kv_list("other")["other"]) == ["m", "n"]
        got = mc.kv_batch_get(["m", "n"], select_fields="x", partition_id="other")["x"]
        assert torch.equal(got, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


# -- damaged and foreign directories -----------------------------------------------------------
def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace a file and fix the manifest and CURRENT to match: a forged, self-consistent snapshot."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    raw = json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(raw)
    pointer = {"version": folder.name, "manifest_sha256": hashlib.sha256(raw).hexdigest()}
    (folder.parent / "CURRENT").write_text(json.dumps(pointer))


def _edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    raw = json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(raw)
    pointer = {"version": folder.name, "manifest_sha256": hashlib.sha256(raw).hexdigest()}
    (folder.parent / "CURRENT").write_text(json.dumps(pointer))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("unpickled!",))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped bit": (lambda v: _flip(v / "p0.g0.pt"), r"p0\.g0\.pt.*sha256"),
    "truncated": (lambda v: (v / "p0.rows").write_bytes((v / "p0.rows").read_bytes()[:-3]), r"p0\.rows: has \d+ bytes"),
    "file missing": (lambda v: (v / "p0.g1.objects").unlink(), r"p0\.g1\.objects: is missing"),
    "manifest changed": (lambda v: _flip(v / "manifest.json"), r"does not match the sha256 that .*CURRENT"),
    "CURRENT garbage": (lambda v: (v.parent / "CURRENT").write_text("{nope"), r"CURRENT.*not valid JSON"),
    "version gone": (lambda v: shutil.rmtree(v), r"manifest.json cannot be read"),
    "foreign format": (lambda v: _edit_manifest(v, lambda m: m.update(format="other-tool")), r"'other-tool'"),
    "newer version": (
        lambda v: _edit_manifest(v, lambda m: m.update(version=99)),
        r"version 99.*reads versions up to 1",
    ),
    "manifest lies": (
        lambda v: _edit_manifest(v, lambda m: m["partitions"][0].update(rows=3)),
        r"keys, tags and groups",
    ),
    "odd file name": (lambda v: _edit_manifest(v, lambda m: m["files"].update({"../x": {}})), r"unexpected name"),
    "rows forged": (
        lambda v: _rewrite(v, "p0.rows", msgpack.packb({"keys": [1], "tags": [{}]})),
        r"keys, tags and groups",
    ),
    "pickle in .pt": (lambda v: _rewrite(v, "p0.g0.pt", _pickled()), r"p0\.g0\.pt: cannot be read as tensors"),
    "short column": (lambda v: _rewrite(v, "p0.g1.objects", msgpack.packb({"msg": ["x"]})), r"field 'msg'"),
}


def _pickled() -> bytes:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"evil-{os.getpid()}.pt"
    torch.save({"dense": {"x": _Evil()}}, path)
    try:
        return path.read_bytes()
    finally:
        path.unlink()


@pytest.fixture
def holding() -> Iterator[DataPlaneClient]:
    """A store already holding rows in the partition a snapshot names, and in another."""
    with dataplane.connect("memory://") as c:
        c.kv_batch_put(["a", "q"], {"x": torch.arange(2.0)}, partition_id="train", tags=[{"here": 1}, {}])
        c.kv_batch_put(["w"], None, partition_id="keep", tags=[{"k": 1}])
        yield c


def _whole_store(c: DataPlaneClient) -> dict[str, Any]:
    return {pid: partition_state(c, pid) for pid in c.kv_list()}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_snapshot_raises_what_is_wrong_and_loads_nothing(
    damage: str, tmp_path: Path, holding: DataPlaneClient
) -> None:
    save_generation(tmp_path / "snap", 1)
    folder = snapshot_info(tmp_path / "snap", verify=True).path
    assert {"manifest.json", "p0.rows", "p0.g0.pt", "p0.g1.objects"} <= {p.name for p in folder.iterdir()}
    harm, message = DAMAGE[damage]
    harm(folder)
    before = _whole_store(holding)
    with pytest.raises(SnapshotError, match=message) as caught:
        load_snapshot(holding, tmp_path / "snap")
    assert "nothing was loaded" in str(caught.value) or damage == "newer version"
    after = _whole_store(holding)
    assert after.keys() == before.keys()
    for pid in before:
        same_state(after[pid], before[pid])
    with pytest.raises(SnapshotError):
        snapshot_info(tmp_path / "snap", verify=True)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 40) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(node: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*at, k))


def _replaced(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node[path[0]] = _replaced(node[path[0]], path[1:], value)
    return node


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fuzz") / "snap"
    save_generation(base, 1)
    return base


@given(data=st.data())
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_a_forged_manifest_or_rows_file_is_refused_or_loaded_whole(data: st.DataObject, fuzz_base: Path) -> None:
    """Any one node of the manifest or of a rows file replaced by any JSON value, checksums forged to
    match: the load raises SnapshotError and changes nothing, or loads (a harmless change)."""
    target = data.draw(st.sampled_from(["manifest.json", "p0.rows", "p1.rows"]))
    work = Path(tempfile.mkdtemp()) / "snap"
    try:
        shutil.copytree(fuzz_base, work)
        folder = work / "v000001"
        raw = (folder / target).read_bytes()
        doc = json.loads(raw) if target == "manifest.json" else msgpack.unpackb(raw, strict_map_key=False)
        where = data.draw(st.sampled_from(list(_paths(doc))))
        doc = _replaced(doc, where, data.draw(JSON))
        if target == "manifest.json":
            manifest = json.dumps(doc).encode()
            (folder / "manifest.json").write_bytes(manifest)
            (work / "CURRENT").write_text(
                json.dumps({"version": "v000001", "manifest_sha256": hashlib.sha256(manifest).hexdigest()})
            )
        else:
            _rewrite(folder, target, msgpack.packb(doc))
        with dataplane.connect("memory://") as c:
            c.kv_batch_put(["a", "k1"], {"x": torch.ones(2, 256)}, partition_id="train", tags=[{"here": 1}, {}])
            before = _whole_store(c)
            try:
                load_snapshot(c, work)
            except SnapshotError:
                after = _whole_store(c)
                assert after.keys() == before.keys()
                for pid in before:
                    same_state(after[pid], before[pid])
    finally:
        shutil.rmtree(work.parent)


def test_no_snapshot_and_foreign_directories(tmp_path: Path, holding: DataPlaneClient) -> None:
    before = _whole_store(holding)
    with pytest.raises(SnapshotNotFound, match="does not exist"):
        load_snapshot(holding, tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):  # also the builtin
        load_snapshot(holding, tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SnapshotNotFound, match="it is empty"):
        load_snapshot(holding, tmp_path / "empty")
    foreign = tmp_path / "model"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(SnapshotNotFound, match=r"'weights\.bin'"):
        load_snapshot(holding, foreign)
    with pytest.raises(SnapshotError, match=r"not a snapshot's.*'weights\.bin'"):
        save_snapshot(holding, foreign)
    assert os.listdir(foreign) == ["weights.bin"]  # refused: nothing removed, nothing added
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(SnapshotNotFound, match="is a file"):
        load_snapshot(holding, tmp_path / "file")
    with pytest.raises(SnapshotError, match="is a file"):
        save_snapshot(holding, tmp_path / "file")
    half = tmp_path / "half"
    half.mkdir()
    (half / ".tmp-0123").mkdir()  # a first save that was killed
    with pytest.raises(SnapshotNotFound, match="did not finish"):
        load_snapshot(holding, half)
    after = _whole_store(holding)
    for pid in before:
        same_state(after[pid], before[pid])


def test_saves_replace_the_last_and_a_version_loads_directly(tmp_path: Path) -> None:
    path = tmp_path / "snap"
    for gen in range(3):
        save_generation(path, gen)
    info = snapshot_info(path, verify=True)
    assert info.metadata == {"gen": 2} and info.path.name == "v000003" and info.nbytes > 0
    assert sorted(os.listdir(path)) == [".lock", "CURRENT", "v000003"]
    assert loaded_state(info.path)[0] == {"gen": 2}  # a version directory is a snapshot too


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with dataplane.connect("memory://", pickle_fields=["obj"]) as c:
        c.kv_batch_put(["a"], {"x": torch.zeros(1)}, partition_id="p")
        for bad in ("p", ["p", "p"], [1]):
            with pytest.raises(InvalidArgument, match="partitions"):
                save_snapshot(c, tmp_path / "s", bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="JSON"):
            save_snapshot(c, tmp_path / "s", metadata={"t": torch.zeros(1)})
        with pytest.raises(InvalidArgument, match="attempts"):
            save_snapshot(c, tmp_path / "s", attempts=0)
        c.kv_batch_put(["b"], {"obj": [{1, 2}]}, partition_id="q")  # a set: pickle only
        with pytest.raises(InvalidArgument, match="msgpack cannot"):
            save_snapshot(c, tmp_path / "s")
        assert not (tmp_path / "s" / "CURRENT").exists()
        save_snapshot(c, tmp_path / "s", ["p"])
        with pytest.raises(InvalidArgument, match="partitions"):
            load_snapshot(c, tmp_path / "s", "p")  # type: ignore[arg-type]


def test_a_second_save_into_a_directory_being_saved_is_refused(tmp_path: Path) -> None:
    with dataplane.connect("memory://") as c:
        c.kv_batch_put(["a"], {"x": torch.zeros(1)}, partition_id="p")
        save_snapshot(c, tmp_path / "s")
        with open(tmp_path / "s" / ".lock", "rb") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a save in progress holds
            with pytest.raises(SnapshotConflict, match="another save"):
                save_snapshot(c, tmp_path / "s")
        assert save_snapshot(c, tmp_path / "s").partitions == {"p": 1}


# -- rows that change during a save: consistent or refused -------------------------------------
class _Meddling:
    """A client whose n-th read of rows first lets ``meddle`` write through the real client, for the
    reads ``when(n)`` picks."""

    def __init__(
        self, real: DataPlaneClient, meddle: Callable[[DataPlaneClient, int], None], when: Callable[[int], bool]
    ) -> None:
        self.real, self.meddle, self.when, self.reads = real, meddle, when, 0

    def kv_batch_get(self, *args: Any, **kwargs: Any) -> Any:
        if self.when(self.reads):
            self.meddle(self.real, self.reads)
        self.reads += 1
        return self.real.kv_batch_get(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


# Reads of one attempt on fill_generation's rows (rows_per_file=10): 4 groups (train: 8 rows with adv,
# then 10 + 6 without; val: 1), read once (reads 0-3), then again (reads 4-7).
MEDDLING: dict[str, tuple[Callable[[DataPlaneClient, int], None], int, str]] = {
    "value rewritten": (  # k3 is in the first group: rewritten before its second read
        lambda c, i: c.kv_batch_put(["k3"], {"x": torch.full((1, 256), float(i))}, partition_id="train"),
        4,
        "values of rows of partition 'train'",
    ),
    "tag changed": (
        lambda c, i: c.kv_batch_put(["k0"], None, partition_id="train", tags=[{"seen": i}]),
        0,
        "keys, order or tags of partition",
    ),
    "row added": (
        lambda c, i: c.kv_batch_put([f"new{i}"], None, partition_id="val", tags=[{}]),
        2,
        "keys, order or tags of partition",
    ),
    "row cleared": (lambda c, i: c.kv_clear([f"k{i}"], partition_id="train"), 1, "cleared while"),
    "field added": (
        lambda c, i: c.kv_batch_put(["v"], {"extra": torch.tensor([i])}, partition_id="val"),
        6,
        "(fields|values) of rows of partition 'val'",  # the field, then its value on the next attempt
    ),
}


@pytest.mark.parametrize("meddle", list(MEDDLING))
def test_rows_changed_during_a_save_are_refused_or_saved_as_of_one_instant(meddle: str, tmp_path: Path) -> None:
    """A write between a save's reads is seen: with a write during every attempt the save is refused
    (SnapshotConflict naming what changed) and the previous snapshot stays; with one write during
    the first attempt, the second attempt saves the store as it is after the write."""
    write, at, message = MEDDLING[meddle]
    path = tmp_path / "snap"
    save_generation(path, 1)
    with dataplane.connect("memory://") as c:
        fill_generation(c, 2)
        quiet = _Meddling(c, write, lambda n: False)
        save_snapshot(quiet, path, metadata={"gen": 2}, rows_per_file=10)  # type: ignore[arg-type]
        assert quiet.reads == 8
        save_generation(path, 1)
        always = _Meddling(c, write, lambda n: True)
        with pytest.raises(SnapshotConflict, match=message) as caught:
            save_snapshot(always, path, metadata={"gen": 2}, attempts=2, rows_per_file=10)  # type: ignore[arg-type]
        assert "2 attempt(s)" in str(caught.value)
        assert snapshot_info(path).metadata == {"gen": 1} and sorted(os.listdir(path)) == [
            ".lock",
            "CURRENT",
            "v000003",
        ]
        fill_generation(c, 2)
        once = _Meddling(c, write, lambda n: n == at)
        save_snapshot(once, path, metadata={"gen": 2}, attempts=2, rows_per_file=10)  # type: ignore[arg-type]
        assert once.reads > 8, "the first attempt was not thrown away"
        want = {pid: partition_state(c, pid) for pid in PARTS}  # the store as it is now, after the write
    with dataplane.connect("memory://") as fresh:
        assert load_snapshot(fresh, path).metadata == {"gen": 2}
        for pid in PARTS:
            same_state(partition_state(fresh, pid), want[pid])


def test_a_writer_thread_during_saves_never_tears_them(tmp_path: Path) -> None:
    """A thread re-puts every row of ``train`` (one put, all rows equal to its generation), in bursts
    of 50 ms with 50 ms pauses, while saves run one after another: each save is refused
    (SnapshotConflict) or holds one generation on every row; both happen."""
    path = tmp_path / "snap"
    keys = [f"k{i}" for i in range(64)]
    stop, puts, outcomes = threading.Event(), [0], {"refused": 0, "saved": 0}
    with dataplane.connect("memory://") as c:
        c.kv_batch_put(keys, {"g": torch.zeros(64, 1024)}, partition_id="train")

        def writer() -> None:
            while not stop.is_set():
                burst = time.monotonic() + 0.05
                while time.monotonic() < burst:
                    puts[0] += 1
                    c.kv_batch_put(keys, {"g": torch.full((64, 1024), float(puts[0]))}, partition_id="train")
                stop.wait(0.05)

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        try:
            while not (outcomes["refused"] and outcomes["saved"] > 2) and time.monotonic() < deadline:
                try:
                    save_snapshot(c, path, attempts=1, rows_per_file=16)
                except SnapshotConflict:
                    outcomes["refused"] += 1
                    continue
                outcomes["saved"] += 1
                with dataplane.connect("memory://") as fresh:
                    load_snapshot(fresh, path)
                    got = fresh.kv_batch_get(keys, select_fields="g", partition_id="train")["g"]
                assert got.unique().numel() == 1, "a torn snapshot: rows of several generations"
        finally:
            stop.set()
            thread.join(timeout=30)
        assert not thread.is_alive()
    assert outcomes["refused"] and outcomes["saved"] > 2, outcomes
