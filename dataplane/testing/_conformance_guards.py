"""The conformance suite's guarantees beyond round trips and semantics: results a caller keeps, empty
tensors, concurrent and async use, bad input that changes nothing, capacity, lifecycle. Part of
:class:`~dataplane.testing.conformance.ClientConformance`."""

from __future__ import annotations

import asyncio
import gc
import io
import threading
import time
import uuid
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dataplane.client import DataPlaneClient
from dataplane.errors import (
    CapacityExceeded,
    ClientClosed,
    DataPlaneError,
    InvalidArgument,
    KeyNotFound,
    SchemaError,
)
from dataplane.testing._conformance_base import _SLOW, ConformanceBase, _concat, _jagged
from dataplane.testing.strategies import ALL_DTYPES, bit_exact, object_values, random_tensor

__all__ = ["ConformanceGuards"]


class ConformanceGuards(ConformanceBase):
    """Results kept, concurrency, bad input, capacity and lifecycle (see the module docstring)."""

    # -- results the caller keeps ----------------------------------------------------------------
    @staticmethod
    def _keepable(n: int, width: int, seed: int) -> dict[str, Any]:
        """Fields of several dtypes, a jagged one and an object column; ``width`` sizes the rows
        (40,000: fields of megabytes, which stores land in shared slabs)."""
        lens = [(seed * 7 + i * 5) % 9 + (i % 3) * width for i in range(n)]
        return {
            "f32": random_tensor((n, width), torch.float32, seed),
            "bf16": random_tensor((n, width), torch.bfloat16, seed + 1),
            "flag": random_tensor((n,), torch.bool, seed + 2),
            "ids": _jagged([random_tensor((m,), torch.int64, seed + 3 + i) for i, m in enumerate(lens)]),
            "msg": [{"row": i, "seed": seed, "text": "x" * (i % 4)} for i in range(n)],
        }

    @staticmethod
    def _rows(fields: dict[str, Any], rows: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {f: fields[f][rows] for f in ("f32", "bf16", "flag")}
        ids = fields["ids"].unbind()
        out["ids"] = _jagged([ids[i] for i in rows])
        out["msg"] = [fields["msg"][i] for i in rows]
        return out

    @staticmethod
    def _check_kept(got: Any, want: dict[str, Any]) -> None:
        for f in ("f32", "bf16", "flag"):
            assert bit_exact(got[f], want[f]), f
        assert got["ids"].is_nested and len(got["ids"]) == len(want["ids"])
        assert all(bit_exact(a, b) for a, b in zip(got["ids"].unbind(), want["ids"].unbind(), strict=True))
        assert got["msg"] == want["msg"] and type(got["msg"]) is list

    @pytest.mark.parametrize("width", [4, 40_000], ids=["small", "large"])
    def test_results_save_and_load(self, client: DataPlaneClient, pid: str, width: int) -> None:
        """``torch.save`` of what a get returns, by meta and by keys over two puts, and ``torch.load``
        of it give the same batch back: fields of other dtypes never share a storage (``torch.save``
        refuses one storage viewed as several types), and saving one field writes its own bytes,
        not its neighbours'."""
        n = 8
        keys, more = [f"s{i}" for i in range(n)], [f"t{i}" for i in range(n)]
        first, second = self._keepable(n, width, 1), self._keepable(n, width, 2)
        meta = client.kv_batch_put(keys, first, partition_id=pid)
        client.kv_batch_put(more, second, partition_id=pid)
        fields = list(first)
        picks = [(second, 5), (first, 2), (second, 0), (first, 7)]  # rows of both puts, out of order
        mixed = {f: _concat([self._rows(src, [i])[f] for src, i in picks]) for f in fields}
        gets = [
            (client.kv_batch_get(meta, select_fields=fields), first),
            (client.kv_batch_get([more[5], keys[2], more[0], keys[7]], partition_id=pid, select_fields=fields), mixed),
        ]
        for got, want in gets:
            saved = io.BytesIO()
            torch.save(got, saved)
            saved.seek(0)
            self._check_kept(torch.load(saved), want)
            self._check_kept(got, want)
            saved = io.BytesIO()
            torch.save({f: got[f] for f in fields}, saved)  # the fields alone, as plain values
            saved.seek(0)
            self._check_kept(torch.load(saved), want)
            for f in ("f32", "bf16", "flag"):
                one = io.BytesIO()
                torch.save(got[f], one)
                assert one.tell() < got[f].nbytes + 4096, f"saving {f!r} wrote other fields' bytes too"

    def test_kept_results_never_change(self, client: DataPlaneClient, pid: str) -> None:
        """A result the caller keeps (some fields of it, the rest dropped) holds its values while the
        store reuses its memory for later gets of the same sizes, rewrites and clears of its rows,
        and after the client that read it has closed."""
        n, width = 8, 40_000
        keys = [f"k{i}" for i in range(n)]
        first = self._keepable(n, width, 3)
        # a second client of the same store where there can be one; it closes before the check
        reader = self.make_client() if client.capabilities.cross_process else client
        try:
            got = reader.kv_batch_get(client.kv_batch_put(keys, first, partition_id=pid), select_fields=list(first))
            kept = {f: got[f] for f in ("f32", "ids", "msg")}
            del got
            gc.collect()
            for seed in range(4, 8):
                other = self._keepable(n, width, seed)
                meta = client.kv_batch_put(keys, other, partition_id=pid)
                for c in dict.fromkeys((reader, client)):
                    again = c.kv_batch_get(meta, select_fields=list(other))
                    self._check_kept(again, other)
                    del again
                    gc.collect()
            client.kv_clear(partition_id=pid)
        finally:
            if reader is not client:
                reader.close()
        gc.collect()
        assert bit_exact(kept["f32"], first["f32"])
        assert all(bit_exact(a, b) for a, b in zip(kept["ids"].unbind(), first["ids"].unbind(), strict=True))
        assert kept["msg"] == first["msg"]

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool, torch.complex64], ids=str)
    def test_empty_tensors_round_trip(self, client: DataPlaneClient, pid: str, dtype: torch.dtype) -> None:
        dense = client.empty((3, 2, 5), dtype)
        assert dense.shape == (3, 2, 5) and dense.dtype == dtype and dense.device.type == "cpu"
        dense.copy_(random_tensor((3, 2, 5), dtype, seed=1))
        values = client.empty(7, dtype)
        values.copy_(random_tensor((7,), dtype, seed=2))
        jagged = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 4, 4, 7]))
        want_dense, want_values = dense.clone(), values.clone()
        meta = client.kv_batch_put(["a", "b", "c"], {"d": dense, "j": jagged}, partition_id=pid)
        dense.zero_()  # the store holds what the put sent, not the caller's buffer
        values.zero_()
        out = client.kv_batch_get(meta, select_fields=["d", "j"])
        assert bit_exact(out["d"], want_dense) and bit_exact(out["j"].values(), want_values)
        assert client.empty(0, dtype).shape == (0,) and client.empty((2, 0), dtype).shape == (2, 0)
        assert client.empty(torch.Size([2, 3]), dtype).shape == (2, 3)
        for shape in (-1, (2, -3), (2, "x"), 2.5, (True,)):
            with pytest.raises(InvalidArgument):
                client.empty(shape, dtype)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            client.empty(3, "float32")  # type: ignore[arg-type]

    def test_concurrent_writers(self, client: DataPlaneClient, pid: str) -> None:
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                keys = [f"t{t}_{i}" for i in range(16)]
                client.kv_batch_put(keys, {"x": torch.full((16, 4), t)}, partition_id=pid)
                assert client.kv_batch_get(keys, partition_id=pid, select_fields="x")["x"].eq(t).all()
            except BaseException as e:  # collected and re-raised below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, errors
        assert len(client.kv_list(pid)[pid]) == 64

    @staticmethod
    def _version(v: int) -> dict[str, Any]:
        """Put number ``v`` of the one row :meth:`test_rewrites_are_read_whole` rewrites: every value
        and the jagged row's length say which put."""
        return {
            "ids": _jagged([torch.full(((v * 5) % 9 + 1,), v, dtype=torch.int64)]),
            "lp": torch.full((1, 6), float(v)),
            "msg": [{"v": v, "pad": "x" * (v % 5)}],
        }

    def test_rewrites_are_read_whole(self, client: DataPlaneClient, pid: str) -> None:
        """One writer re-puts one key, each put of other lengths and values (a jagged, a dense and an
        object field together), while two readers get it: every read is one put's row, whole, in
        every field. A get may raise ``KeyNotFound`` when the row keeps changing under it; nothing
        else, and never a mix of two puts."""
        seconds, done = 1.5, threading.Event()
        client.kv_batch_put(["k"], self._version(1), partition_id=pid)
        problems: list[str] = []
        reads = [0, 0]

        def write() -> None:
            v = 1
            try:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    v += 1
                    client.kv_batch_put(["k"], self._version(v), partition_id=pid)
            except BaseException as e:  # collected and reported below
                problems.append(f"writer: {type(e).__name__}: {e}")
            finally:
                done.set()

        def read(r: int) -> None:
            limit = time.monotonic() + 60  # the row stops changing once the writer is done
            try:
                while (not done.is_set() or reads[r] == 0) and time.monotonic() < limit:
                    try:
                        got = client.kv_batch_get(["k"], partition_id=pid, select_fields=["ids", "lp", "msg"])
                    except KeyNotFound:
                        continue
                    reads[r] += 1
                    v = got["msg"][0]["v"]
                    want = self._version(v)
                    same = bit_exact(got["lp"], want["lp"]) and got["msg"] == want["msg"]
                    if not same or not bit_exact(got["ids"].unbind()[0], want["ids"].unbind()[0]):
                        ids, lp = got["ids"].unbind()[0].tolist(), got["lp"][0].tolist()
                        problems.append(f"reader {r}: ids={ids} lp={lp} msg={got['msg']} is no one put's row")
                        return
            except BaseException as e:  # collected and reported below
                problems.append(f"reader {r}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(r,)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads), "a reader or the writer did not finish in 120 s"
        assert not problems, problems
        assert all(reads), f"a reader read nothing: {reads}"

    def test_async_twins_and_sync_inside_loop(self, client: DataPlaneClient, pid: str) -> None:
        async def main() -> None:
            meta = await client.async_kv_batch_put(["a"], {"x": torch.tensor([5])}, partition_id=pid)
            out = await client.async_kv_batch_get(meta, select_fields=["x"])
            assert out["x"].tolist() == [5]
            assert client.kv_batch_get(meta, select_fields=["x"])["x"].tolist() == [5]  # sync, loop running
            assert "a" in (await client.async_kv_list(pid))[pid]
            await client.async_kv_clear(["a"], partition_id=pid)

        asyncio.run(asyncio.wait_for(main(), timeout=120))

    # -- bad input never corrupts ---------------------------------------------------------------
    def _bad_puts(self) -> list[tuple[str, type[BaseException], Any, Any]]:
        t = torch.zeros(2, 3)
        return [
            ("duplicate keys", InvalidArgument, ["a", "a"], {"x": t}),
            ("size mismatch", InvalidArgument, ["a", "b", "c"], {"x": t}),
            ("non-str key", SchemaError, ["a", 3], {"x": t}),
            ("single str keys", SchemaError, "ab", {"x": t}),
            ("empty keys", InvalidArgument, [], {"x": t}),
            ("dtype change", SchemaError, ["a", "b"], {"x": t.double()}),
            ("trailing shape change", SchemaError, ["a", "b"], {"x": torch.zeros(2, 4)}),
            ("kind change", SchemaError, ["a", "b"], {"x": _jagged([torch.zeros(1, 3), torch.zeros(2, 3)])}),
            ("unsupported leaf", SchemaError, ["a", "b"], {"y": object()}),
            ("0-d tensor", SchemaError, ["a", "b"], {"y": torch.tensor(1.0)}),
            ("unencodable object", SchemaError, ["a", "b"], {"y": [object(), 1]}),
            ("bad field name", SchemaError, ["a", "b"], {"bad name": t}),
            ("empty fields", InvalidArgument, ["a", "b"], {}),
            ("second field bad", SchemaError, ["a", "b"], {"ok_new": t, "x": t.int()}),
            ("sparse tensor", SchemaError, ["a", "b"], {"y": torch.eye(2).to_sparse()}),
            ("meta tensor", SchemaError, ["a", "b"], {"y": torch.empty(2, 3, device="meta")}),
        ]

    def test_bad_puts_raise_typed_and_change_nothing(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(["a", "b"], {"x": torch.ones(2, 3)}, partition_id=pid, tags=[{"v": 1}, {"v": 2}])
        before = client.kv_list()
        for name, exc, keys, fields in self._bad_puts():
            with pytest.raises(exc):
                client.kv_batch_put(keys, fields, partition_id=pid)
            assert client.kv_list() == before, name
        with pytest.raises(KeyNotFound):  # the failed multi-field put left no column behind
            client.kv_batch_get(["a"], partition_id=pid, select_fields=["ok_new"])
        assert client.kv_batch_get(["a", "b"], partition_id=pid, select_fields="x")["x"].eq(1).all()

    @given(data=st.data())
    @_SLOW
    def test_random_bad_inputs_change_nothing(self, client: DataPlaneClient, data: st.DataObject) -> None:
        pid = f"bad-{uuid.uuid4().hex[:10]}"
        try:
            client.kv_batch_put(["a", "b"], {"x": torch.ones(2, 3), "o": ["p", "q"]}, partition_id=pid)
            before = client.kv_list()
            keys: list[Any] = data.draw(
                st.one_of(
                    st.lists(st.sampled_from(["a", "b", "c"]), min_size=2, max_size=2).filter(
                        lambda k: len(set(k)) < 2
                    ),
                    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True).filter(
                        lambda k: len(k) != 2
                    ),
                    st.just(["a", 1]),
                    st.just(["", "b"]),
                ),
                label="keys",
            )
            value = data.draw(
                st.one_of(
                    st.sampled_from(ALL_DTYPES).map(
                        lambda d: random_tensor((2, 3), d) if d != torch.float32 else torch.ones(2, 4)
                    ),
                    st.lists(object_values, min_size=2, max_size=2),
                    st.just(torch.ones(2, 3)),
                ),
                label="value",
            )
            with pytest.raises(DataPlaneError):
                client.kv_batch_put(keys, {"x": value}, partition_id=pid)
            assert client.kv_list() == before
            assert client.kv_batch_get(["a", "b"], partition_id=pid, select_fields="x")["x"].eq(1).all()
        finally:
            client.kv_clear(partition_id=pid)

    def test_capacity_exceeded_writes_nothing(self) -> None:
        limited = self.make_limited_client(capacity_bytes=64 * 1024, capacity_rows=8)
        if limited is None:
            pytest.skip("this adapter cannot bound its capacity from a client option")
        with limited:
            limited.kv_batch_put([f"k{i}" for i in range(4)], {"x": torch.zeros(4, 1024)}, partition_id="cap")
            before = limited.kv_list()
            with pytest.raises(CapacityExceeded):
                limited.kv_batch_put([f"n{i}" for i in range(4)], {"y": torch.zeros(4, 4096)}, partition_id="cap")
            with pytest.raises(CapacityExceeded):
                limited.kv_batch_put([f"r{i}" for i in range(5)], {"x": torch.zeros(5, 1)}, partition_id="cap2")
            assert limited.kv_list() == before
            limited.kv_clear(partition_id="cap")
            limited.kv_batch_put([f"n{i}" for i in range(4)], {"x": torch.zeros(4, 4096)}, partition_id="cap")

    # -- lifecycle ------------------------------------------------------------------------------
    def test_close_is_idempotent_and_final(self) -> None:
        c = self.make_client()
        c.kv_batch_put(["a"], {"x": torch.zeros(1)}, partition_id="life")
        c.kv_clear(partition_id="life")
        c.close()
        c.close()
        with pytest.raises(ClientClosed):
            c.kv_batch_put(["a"], {"x": torch.zeros(1)}, partition_id="life")
        with pytest.raises(ClientClosed):
            c.kv_batch_get(["a"], partition_id="life", select_fields="x")
        with pytest.raises(ClientClosed):
            c.kv_list()
