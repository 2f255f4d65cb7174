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

import uuid
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dataplane.client import DataPlaneClient
from dataplane.codec.jagged import materialize
from dataplane.errors import (
    InvalidArgument,
    KeyNotFound,
    SchemaError,
)
from dataplane.meta import MAX_KEY_LEN, KVBatchMeta
from dataplane.testing._conformance_base import _SLOW, AWKWARD_KEYS, _jagged, _rows_of
from dataplane.testing._conformance_claims import ConformanceClaims
from dataplane.testing._conformance_guards import ConformanceGuards
from dataplane.testing._conformance_snapshot import ConformanceSnapshot
from dataplane.testing.strategies import ALL_DTYPES, bit_exact, ragged_batches, random_tensor

__all__ = ["ClientConformance"]


class ClientConformance(ConformanceGuards, ConformanceSnapshot, ConformanceClaims):
    """Shared semantics of every :class:`~dataplane.client.DataPlaneClient`: round trips and semantics
    here, the rest in :class:`~dataplane.testing._conformance_guards.ConformanceGuards`, snapshots in
    :class:`~dataplane.testing._conformance_snapshot.ConformanceSnapshot`, consumption by task in
    :class:`~dataplane.testing._conformance_claims.ConformanceClaims`; the hooks and fixtures in
    :class:`~dataplane.testing._conformance_base.ConformanceBase`."""

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

    def test_awkward_keys_round_trip_list_and_clear(self, client: DataPlaneClient, pid: str) -> None:
        """Every key the core accepts is a key on every backend (:data:`AWKWARD_KEYS`: non-ASCII, other
        Unicode normal forms, separators, whitespace, control characters, reserved-looking names,
        512 characters): put, got back by keys and by meta, listed in first-put order with its tags,
        described and cleared as ``"k0"`` is; and the keys no backend takes are refused alike."""
        keys = list(AWKWARD_KEYS)
        n, half = len(keys), len(keys) // 2
        assert len(set(keys)) == n and max(map(len, keys)) == MAX_KEY_LEN
        order = keys[half:] + keys[:half]  # first-put order
        first = client.kv_batch_put(
            order[:half],
            {"x": torch.arange(half), "msg": order[:half]},
            partition_id=pid,
            tags=[{"k": k} for k in order[:half]],
        )
        rest = order[half:]
        client.kv_batch_put(
            rest, {"x": torch.arange(half, n), "msg": rest}, partition_id=pid, tags=[{"k": k} for k in rest]
        )
        client.kv_batch_put(keys[::3], {"y": torch.ones(len(keys[::3]))}, partition_id=pid)  # a rewrite keeps the order
        listed = client.kv_list(pid)[pid]
        assert list(listed) == order and all(listed[k] == {"k": k} for k in keys)
        shuffled = keys[1::2] + keys[::2]
        got = client.kv_batch_get(shuffled, partition_id=pid, select_fields=["x", "msg"])
        assert got["msg"] == shuffled and got["x"].tolist() == [order.index(k) for k in shuffled]
        travelled = KVBatchMeta.from_msgpack(first.to_msgpack())  # a meta another process got
        assert client.kv_batch_get(travelled, select_fields=["msg"])["msg"] == order[:half]
        info = client.kv_describe(keys, partition_id=pid)
        assert list(info) == keys and all(
            info[k].fields == ({"x", "msg", "y"} if i % 3 == 0 else {"x", "msg"}) for i, k in enumerate(keys)
        )
        client.kv_clear(keys[::2], partition_id=pid)
        assert list(client.kv_list(pid)[pid]) == [k for k in order if k in set(keys[1::2])]
        with pytest.raises(KeyNotFound):
            client.kv_batch_get(keys[:1], partition_id=pid, select_fields=["x"])
        assert client.kv_batch_get(keys[1::2], partition_id=pid, select_fields=["msg"])["msg"] == keys[1::2]
        before = client.kv_list()
        for bad in ("", "a\x00b", "k" * (MAX_KEY_LEN + 1), "\ud800"):  # refused by the core, alike everywhere
            with pytest.raises(InvalidArgument):
                client.kv_batch_put(["fine", bad], {"x": torch.zeros(2, dtype=torch.int64)}, partition_id=pid)
        assert client.kv_list() == before
        client.kv_clear(keys[1::2], partition_id=pid)
        assert client.kv_list(pid).get(pid, {}) == {}

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
