"""The conformance suite every adapter passes unchanged.

Subclass :class:`ClientConformance` in a test module and implement :meth:`make_client`::

    class TestMyAdapter(ClientConformance):
        def make_client(self, **options):
            return dataplane.connect("myscheme://...", **options)

One client is made per test class (backends can be slow to start); each test writes to a fresh
partition and clears it afterwards. Adapters that cannot bound capacity return None from
:meth:`make_limited_client`, and those tests are skipped with that reason.
"""

from __future__ import annotations

import asyncio
import gc
import io
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane.client import DataPlaneClient
from dataplane.codec.jagged import materialize
from dataplane.errors import (
    CapacityExceeded,
    ClientClosed,
    DataPlaneError,
    InvalidArgument,
    KeyNotFound,
    SchemaError,
)
from dataplane.meta import KVBatchMeta
from dataplane.testing.strategies import ALL_DTYPES, bit_exact, object_values, ragged_batches, random_tensor

__all__ = ["ClientConformance"]

_SLOW = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], list):
        return [x for p in parts for x in p]
    if parts[0].is_nested:
        return _jagged([r for p in parts for r in p.unbind()])
    return torch.cat(parts)


def _rows_of(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind()) if t.is_nested else list(t.unbind(0))


class ClientConformance:
    """Shared semantics of every :class:`~dataplane.client.DataPlaneClient`."""

    def make_client(self, **options: Any) -> DataPlaneClient:
        raise NotImplementedError("subclass ClientConformance and return a fresh client from make_client()")

    def make_limited_client(
        self, *, capacity_bytes: int | None = None, capacity_rows: int | None = None
    ) -> DataPlaneClient | None:
        """A client whose store holds at most this much, or None if the adapter cannot bound it."""
        return None

    # -- fixtures -------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls) -> Iterator[DataPlaneClient]:  # a classmethod: pytest 9.1+ deprecates class-scoped instance methods
        c = cls().make_client()
        yield c
        c.close()

    @pytest.fixture
    def pid(self, client: DataPlaneClient) -> Iterator[str]:
        name = f"conf-{uuid.uuid4().hex[:10]}"
        yield name
        if not getattr(client, "closed", False):
            client.kv_clear(partition_id=name)

    # -- round trips ----------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
    def test_dense_dtypes_bit_exact(self, client: DataPlaneClient, pid: str, dtype: torch.dtype) -> None:
        keys = [f"k{i}" for i in range(5)]
        fields = {"m": random_tensor((5, 3, 2), dtype, 1), "s": random_tensor((5,), dtype, 2)}
        client.kv_batch_put(keys, fields, partition_id=pid)
        out = client.kv_batch_get(keys, partition_id=pid, select_fields=["m", "s"])
        assert bit_exact(out["m"], fields["m"])
        assert bit_exact(out["s"], fields["s"]) and out["s"].shape == (5,)

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
    def test_jagged_dtypes_both_layouts(self, client: DataPlaneClient, pid: str, dtype: torch.dtype) -> None:
        rows = [random_tensor((n, 2), dtype, n) for n in (3, 0, 7, 1)]
        keys = ["a", "b", "c", "d"]
        client.kv_batch_put(keys, {"t": _jagged(rows)}, partition_id=pid)
        nested = client.kv_batch_get(keys, partition_id=pid, select_fields=["t"])["t"]
        assert nested.is_nested and nested.layout == torch.jagged
        assert all(bit_exact(a, b) for a, b in zip(nested.unbind(), rows, strict=True))
        padded = client.kv_batch_get(keys, partition_id=pid, select_fields="t", layout="padded")["t"]
        assert padded.shape == (4, 7, 2) and padded.dtype == dtype
        for i, r in enumerate(rows):
            assert bit_exact(padded[i, : r.shape[0]], r)

    def test_conjugate_and_negative_views_are_stored_as_their_values(self, client: DataPlaneClient, pid: str) -> None:
        z = random_tensor((4, 3), torch.complex64, 3)
        v = random_tensor((5,), torch.complex64, 4)
        fields = {
            "conj": z.conj(),  # torch's conjugate bit: the memory holds z, the tensor means conj(z)
            "neg": z.conj().imag,  # the negative bit
            "jag": torch.nested.nested_tensor_from_jagged(v.conj(), torch.tensor([0, 2, 2, 4, 5])),
        }
        assert fields["conj"].is_conj() and fields["neg"].is_neg() and fields["jag"].values().is_conj()
        keys = ["a", "b", "c", "d"]
        client.kv_batch_put(keys, fields, partition_id=pid)
        out = client.kv_batch_get(keys, partition_id=pid, select_fields=["conj", "neg", "jag"])
        assert torch.equal(out["conj"], z.conj().resolve_conj())
        assert torch.equal(out["neg"], -z.imag)
        assert torch.equal(out["jag"].values(), v.conj().resolve_conj())

    def test_fields_with_equal_lengths_share_a_ragged_dim(self, client: DataPlaneClient, pid: str) -> None:
        lens = (3, 1, 5)
        logp = [torch.randn(n) for n in lens]
        mask = [torch.rand(n) > 0.5 for n in lens]
        keys = ["a", "b", "c"]
        client.kv_batch_put(keys, {"logp": _jagged(logp)}, partition_id=pid)
        client.kv_batch_put(keys, {"mask": _jagged(mask), "ids": _jagged([torch.arange(2)] * 3)}, partition_id=pid)
        out = client.kv_batch_get(keys, partition_id=pid, select_fields=["logp", "mask", "ids"])
        masked = out["logp"] * out["mask"]  # one ragged dim: elementwise ops between fields just work
        for got, lp, m in zip(masked.unbind(), logp, mask, strict=True):
            assert bit_exact(got, lp * m)
        assert out["ids"].shape[1] != out["logp"].shape[1]  # other lengths: another ragged dim

    def test_padding_options(self, client: DataPlaneClient, pid: str) -> None:
        rows = [torch.arange(n) + 1 for n in (3, 5, 1)]
        meta = client.kv_batch_put(
            ["a", "b", "c"], {"ids": _jagged(rows), "lp": _jagged([r.float() for r in rows])}, partition_id=pid
        )
        assert meta.sequence_lengths == (3, 5, 1)
        out = client.kv_batch_get(
            meta, select_fields=["ids", "lp"], layout="padded", pad_values={"ids": -7, "lp": 0.5}, pad_to_multiple=4
        )
        assert out["ids"].shape == (3, 8) and out["ids"][2, 1:].eq(-7).all() and out["lp"][0, 3:].eq(0.5).all()
        out = client.kv_batch_get(meta, select_fields=["ids"], layout="padded", pad_to_length=11)
        assert out["ids"].shape == (3, 11)
        expected = materialize(torch.cat(rows), torch.tensor([0, 3, 8, 9]), pad_to_length=11)
        assert torch.equal(out["ids"], expected)
        with pytest.raises(InvalidArgument):
            client.kv_batch_get(meta, select_fields=["ids"], layout="padded", pad_to_length=2)

    def test_object_columns(self, client: DataPlaneClient, pid: str) -> None:
        values = ["héllo", {"role": "user", "content": [1, 2.5, None]}, [b"\x00raw", True], None]
        keys = [f"o{i}" for i in range(4)]
        client.kv_batch_put(keys, {"msg": values}, partition_id=pid)
        assert client.kv_batch_get(keys, partition_id=pid, select_fields="msg")["msg"] == values

    @given(batch=ragged_batches())
    @_SLOW
    def test_random_batches_round_trip(self, client: DataPlaneClient, batch: tuple[list[str], dict[str, Any]]) -> None:
        keys, fields = batch
        pid = f"hyp-{uuid.uuid4().hex[:10]}"
        try:
            client.kv_batch_put(keys, fields, partition_id=pid)
            order = list(reversed(range(len(keys))))
            out = client.kv_batch_get([keys[i] for i in order], partition_id=pid, select_fields=list(fields))
            for name in ("tokens", "dense", "scalar"):
                got, want = _rows_of(out[name]), _rows_of(fields[name])
                assert all(bit_exact(got[j], want[i]) for j, i in enumerate(order))
            assert out["obj"] == [fields["obj"][i] for i in order]
        finally:
            client.kv_clear(partition_id=pid)

    @given(sizes=st.tuples(st.integers(1, 300), st.integers(1, 300), st.integers(1, 300)), seed=st.integers(0, 2**20))
    @_SLOW
    def test_scattered_rows_of_several_puts(self, client: DataPlaneClient, sizes: tuple[int, ...], seed: int) -> None:
        """Gets of a data-parallel rank's rows (every dp-th) and of random rows in random order, over
        three puts that rewrite each other's rows (the last only one jagged field, with new lengths),
        hundreds of rows each: checked row by row against what was put."""
        g = torch.Generator().manual_seed(seed)
        pid = f"hyp-{uuid.uuid4().hex[:10]}"
        pool = [f"k{i}" for i in range(max(sizes) * 2)]
        model: dict[str, dict[str, Any]] = {}
        try:
            for step, n in enumerate(sizes):
                keys = [pool[int(i)] for i in torch.randperm(len(pool), generator=g)[:n]]
                lens = torch.randint(0, 20, (n,), generator=g).tolist()
                toks = [torch.randint(0, 150_000, (m,), generator=g) for m in lens]
                fields: dict[str, Any] = {"tok": _jagged(toks)}
                if step < 2 or not model:
                    fields["lp"] = _jagged([torch.randn(m, generator=g).to(torch.bfloat16) for m in lens])
                    fields["vec"] = torch.randn(n, 3, generator=g)
                    fields["r"] = torch.randn(n, generator=g).to(torch.float16)
                    fields["obj"] = [
                        {"i": int(i), "s": "x" * (int(i) % 4)} for i in torch.randint(0, 99, (n,), generator=g)
                    ]
                else:
                    keys = [k for k in keys if k in model] or list(model)[:1]
                    toks = toks[: len(keys)] + [torch.arange(3)] * (len(keys) - len(toks))
                    fields = {"tok": _jagged(toks)}
                client.kv_batch_put(keys, fields, partition_id=pid)
                put_rows = {f: v if f == "obj" else _rows_of(v) for f, v in fields.items()}  # unbind once
                for i, k in enumerate(keys):
                    row = model.setdefault(k, {})
                    for f, rows in put_rows.items():
                        row[f] = rows[i]
            names = ["tok", "lp", "vec", "r", "obj"]
            keys = list(model)
            picks = [keys[::dp] for dp in (2, 4, 8)]
            picks.append([keys[int(i)] for i in torch.randperm(len(keys), generator=g)[: max(1, len(keys) // 3)]])
            for want in picks:
                out = client.kv_batch_get(want, partition_id=pid, select_fields=names)
                assert out["obj"] == [model[k]["obj"] for k in want]
                for f in names[:4]:
                    got = _rows_of(out[f])
                    assert len(got) == len(want)
                    bad = [k for k, r in zip(want, got, strict=True) if not bit_exact(r, model[k][f])]
                    assert not bad, (f, bad[:5])
        finally:
            client.kv_clear(partition_id=pid)

    @pytest.mark.parametrize("row_len", [40, 1200], ids=["short_rows", "long_rows"])
    def test_rows_written_back_by_several_ranks(self, client: DataPlaneClient, pid: str, row_len: int) -> None:
        """Four data-parallel ranks each write back a new jagged field, and rewrite a dense one, for
        their rows (every 4th: a balanced split is scattered too); then the whole batch is read in one
        get, forward and reversed, so both fields' rows alternate between puts row by row (the bytes
        of short rows and of long ones are gathered differently). Checked row by row; the new field
        has the rollout's row lengths, so they share one ragged dim."""
        g = torch.Generator().manual_seed(row_len)
        n, dp = 600, 4
        keys = [f"s{i}" for i in range(n)]
        lens = torch.randint(0, row_len, (n,), generator=g).tolist()
        resp = [torch.randint(0, 150_000, (m,), generator=g) for m in lens]
        client.kv_batch_put(keys, {"resp": _jagged(resp), "score": torch.zeros(n, 2)}, partition_id=pid)
        logp = [torch.randn(m, generator=g) for m in lens]
        score = torch.randn(n, 2, generator=g)
        for rank in range(dp):
            mine = list(range(rank, n, dp))
            fields = {"logp": _jagged([logp[i] for i in mine]), "score": score[mine]}
            client.kv_batch_put([keys[i] for i in mine], fields, partition_id=pid)
        for order in (list(range(n)), list(range(n))[::-1]):
            out = client.kv_batch_get(
                [keys[i] for i in order], partition_id=pid, select_fields=["resp", "logp", "score"]
            )
            assert torch.equal(out["score"], score[order])
            for f, rows in (("resp", resp), ("logp", logp)):
                bad = [i for i, got in zip(order, _rows_of(out[f]), strict=True) if not bit_exact(got, rows[i])]
                assert not bad, (f, bad[:5])
            weighted = out["logp"] * out["resp"]  # one ragged dim
            assert torch.equal(weighted.values(), out["logp"].values() * out["resp"].values())

    # -- semantics ------------------------------------------------------------------------------
    def test_get_returns_requested_order_and_fields(self, client: DataPlaneClient, pid: str) -> None:
        keys = [f"r{i}" for i in range(8)]
        client.kv_batch_put(keys, {"x": torch.arange(8), "y": torch.arange(8) * 2}, partition_id=pid)
        out = client.kv_batch_get(["r5", "r0", "r7"], partition_id=pid, select_fields=["y"])
        assert out["y"].tolist() == [10, 0, 14] and list(out.keys()) == ["y"]

    def test_missing_key_and_field_raise(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(["a", "b"], {"x": torch.zeros(2)}, partition_id=pid)
        client.kv_batch_put(["a"], {"z": torch.ones(1)}, partition_id=pid)
        with pytest.raises(KeyNotFound, match="nope"):
            client.kv_batch_get(["a", "nope"], partition_id=pid, select_fields=["x"])
        with pytest.raises(KeyNotFound, match="'z'"):
            client.kv_batch_get(["a", "b"], partition_id=pid, select_fields=["x", "z"])
        with pytest.raises(KeyNotFound, match="never_written"):
            client.kv_batch_get(["a"], partition_id=pid, select_fields=["never_written"])
        with pytest.raises(KeyError):
            client.kv_batch_get(["a"], partition_id=f"{pid}-other", select_fields=["x"])

    def test_select_fields_required(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(["a"], {"x": torch.zeros(1)}, partition_id=pid)
        bad: Any
        for bad in ([], None, ()):
            with pytest.raises(InvalidArgument, match="select_fields"):
                client.kv_batch_get(["a"], partition_id=pid, select_fields=bad)
        with pytest.raises(TypeError):
            client.kv_batch_get(["a"], partition_id=pid)  # type: ignore[call-arg]

    def test_rewrite_replaces_and_new_field_adds(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(
            ["a", "b"], {"x": torch.tensor([1, 2]), "t": _jagged([torch.arange(2), torch.arange(3)])}, partition_id=pid
        )
        client.kv_batch_put(["b"], {"x": torch.tensor([20]), "t": _jagged([torch.arange(9)])}, partition_id=pid)
        client.kv_batch_put(["a", "b"], {"adv": torch.tensor([0.5, -0.5])}, partition_id=pid)
        out = client.kv_batch_get(["a", "b"], partition_id=pid, select_fields=["x", "t", "adv"])
        assert out["x"].tolist() == [1, 20] and out["adv"].tolist() == [0.5, -0.5]
        assert [r.numel() for r in out["t"].unbind()] == [2, 9]

    def test_clear_keys_and_partition_and_isolation(self, client: DataPlaneClient, pid: str) -> None:
        other = f"{pid}-b"
        try:
            client.kv_batch_put(["a", "b", "c"], {"x": torch.arange(3)}, partition_id=pid)
            client.kv_batch_put(["a"], {"x": torch.tensor([99])}, partition_id=other)
            assert client.kv_batch_get(["a"], partition_id=other, select_fields="x")["x"].tolist() == [99]
            client.kv_clear(["a", "unknown"], partition_id=pid)
            assert sorted(client.kv_list(pid)[pid]) == ["b", "c"]
            with pytest.raises(KeyNotFound):
                client.kv_batch_get(["a"], partition_id=pid, select_fields="x")
            client.kv_clear(partition_id=pid)
            assert client.kv_list(pid).get(pid, {}) == {}
            assert client.kv_batch_get(["a"], partition_id=other, select_fields="x")["x"].tolist() == [99]
            # a cleared partition forgets its schema
            client.kv_batch_put(["a"], {"x": torch.tensor([1.5])}, partition_id=pid)
        finally:
            client.kv_clear(partition_id=other)

    def test_tags_and_listing(self, client: DataPlaneClient, pid: str) -> None:
        meta = client.kv_batch_put(["a", "b"], {"x": torch.zeros(2)}, partition_id=pid, tags=[{"r": 1.0}, {"r": 0.0}])
        assert meta.tags == ({"r": 1.0}, {"r": 0.0}) and meta.fields == ("x",)
        client.kv_batch_put(["a"], {"y": torch.zeros(1)}, partition_id=pid, tags=[{"v": 3}])
        assert client.kv_list(pid)[pid] == {"a": {"r": 1.0, "v": 3}, "b": {"r": 0.0}}
        assert pid in client.kv_list()

    def test_tag_only_rows(self, client: DataPlaneClient, pid: str) -> None:
        """A put of tags alone makes rows without fields (listed, described, cleared like any row)
        and merges into existing rows' tags without touching their fields."""
        meta = client.kv_batch_put(["p1", "p2"], None, partition_id=pid, tags=[{"s": "pending"}, {"s": "pending"}])
        assert meta.fields == () and meta.tags == ({"s": "pending"}, {"s": "pending"})
        client.kv_batch_put(["x"], {"v": torch.ones(1, 2)}, partition_id=pid, tags=[{"n": 1}])
        client.kv_batch_put(["p1", "x"], {}, partition_id=pid, tags=[{"s": "running"}, {"n": 2, "m": [1]}])
        assert client.kv_list(pid)[pid] == {"p1": {"s": "running"}, "p2": {"s": "pending"}, "x": {"n": 2, "m": [1]}}
        assert list(client.kv_list(pid)[pid]) == ["p1", "p2", "x"]  # first-put order
        with pytest.raises(KeyNotFound, match="'v'"):
            client.kv_batch_get(["p1"], partition_id=pid, select_fields="v")
        assert client.kv_batch_get(["x"], partition_id=pid, select_fields="v")["v"].eq(1).all()
        client.kv_batch_put(["p2"], {"v": torch.zeros(1, 2)}, partition_id=pid)  # a tag-only row gets a field
        info = client.kv_describe(["p2", "p1"], partition_id=pid)
        assert info["p2"].fields == {"v"} and info["p2"].tags == {"s": "pending"} and info["p1"].fields == set()
        client.kv_clear(["p1"], partition_id=pid)
        assert list(client.kv_list(pid)[pid]) == ["p2", "x"]
        before = client.kv_list()
        with pytest.raises(InvalidArgument, match="neither"):
            client.kv_batch_put(["q"], None, partition_id=pid)
        with pytest.raises(InvalidArgument):
            client.kv_batch_put(["q"], None, partition_id=pid, tags=[{}, {}])
        assert client.kv_list() == before

    def test_describe_reports_fields_and_merged_tags_per_key(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(["a", "b", "c"], {"x": torch.arange(3)}, partition_id=pid, tags=[{"r": 1}, {}, {"r": 3}])
        client.kv_batch_put(
            ["b", "a"], {"y": _jagged([torch.ones(2), torch.ones(1)])}, partition_id=pid, tags=[{}, {"q": "z"}]
        )
        info = client.kv_describe(["c", "nope", "a", "b"], partition_id=pid)
        assert list(info) == ["c", "a", "b"]  # asked order; absent keys left out
        assert info["a"].fields == {"x", "y"} and info["a"].tags == {"r": 1, "q": "z"}
        assert info["b"].fields == {"x", "y"} and info["b"].tags == {}
        assert info["c"].fields == {"x"} and info["c"].tags == {"r": 3}
        info["a"].tags["r"] = 99  # a copy
        assert client.kv_describe(["a"], partition_id=pid)["a"].tags["r"] == 1
        client.kv_clear(["a"], partition_id=pid)
        assert list(client.kv_describe(["a", "b"], partition_id=pid)) == ["b"]
        assert client.kv_describe(["a"], partition_id=f"{pid}-none") == {}
        with pytest.raises(InvalidArgument):
            client.kv_describe(["b", "b"], partition_id=pid)
        with pytest.raises(SchemaError):
            client.kv_describe("b", partition_id=pid)

    def test_get_by_meta(self, client: DataPlaneClient, pid: str) -> None:
        meta = client.kv_batch_put(["a", "b", "c"], {"x": torch.arange(3)}, partition_id=pid)
        sub = KVBatchMeta.from_dict(meta.to_dict()).subset([2, 0])
        assert client.kv_batch_get(sub, select_fields=meta.fields)["x"].tolist() == [2, 0]
        with pytest.raises(InvalidArgument):
            client.kv_batch_get(sub, select_fields=["x"], partition_id=f"{pid}-other")
        with pytest.raises(InvalidArgument):
            client.kv_batch_get(["a"], select_fields=["x"])

    def test_copies_are_independent(self, client: DataPlaneClient, pid: str) -> None:
        src = torch.arange(6).view(2, 3)
        rows = [torch.arange(4), torch.arange(2)]
        client.kv_batch_put(["a", "b"], {"x": src, "t": _jagged(rows)}, partition_id=pid)
        src.fill_(-1)
        rows[0].fill_(-1)
        out = client.kv_batch_get(["a", "b"], partition_id=pid, select_fields=["x", "t"])
        assert out["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
        out["x"].fill_(7)
        out["t"].values().fill_(7)
        again = client.kv_batch_get(["a", "b"], partition_id=pid, select_fields=["x", "t"])
        assert again["x"].tolist() == [[0, 1, 2], [3, 4, 5]] and again["t"].values().tolist() == [0, 1, 2, 3, 0, 1]

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
