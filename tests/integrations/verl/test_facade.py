"""The verl facade's TransferQueue semantics, unit by unit, over an in-process store.

Here the facade is handed a ``memory://`` client (``facade._adopt``): these tests isolate its
translation of TransferQueue's calls. The same calls over real ``mooncake://`` and ``tq://``
deployments, driven by verl's own code, are in ``test_verl_on_facade.py``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import dataplane
from dataplane import KeyNotFound
from integrations.verl import BatchMeta, KVBatchMeta, MissingRows
from integrations.verl import facade as tq


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dataplane.DataPlaneClient]:
    monkeypatch.setenv(tq.STRICT_ENV, "0")
    with dataplane.connect() as client:
        tq._adopt(client)
        try:
            yield client
        finally:
            tq._forget()


def _rollout(lengths: list[int], start: int = 0) -> TensorDict:
    """Rows as verl's agent loop puts them: one session's rows stacked dense ``[n, L]``."""
    (length,) = set(lengths)
    n = len(lengths)
    return TensorDict(
        {
            "responses": torch.arange(start, start + n * length).view(n, length),
            "rm_scores": torch.full((n, length), 0.5),
            "uid": NonTensorStack(*[NonTensorData(f"u{start + i}") for i in range(n)]),
        },
        batch_size=[n],
    )


def test_dense_rows_of_different_lengths_share_a_field_and_read_back_jagged(store: dataplane.DataPlaneClient) -> None:
    """One-row puts of ``[1, 6]`` then ``[1, 8]`` (dataplane's schema alone would refuse the second)."""
    tq.kv_batch_put(keys=["a"], partition_id="train", fields=_rollout([6]))
    tq.kv_batch_put(keys=["b"], partition_id="train", fields=_rollout([8], start=100))
    td = tq.kv_batch_get(keys=["b", "a"], partition_id="train", select_fields=["responses", "rm_scores", "uid"])
    assert list(td.keys()) == ["responses", "rm_scores", "uid"] and td.batch_size == torch.Size([2])
    assert td["responses"].is_nested and td["responses"].offsets().tolist() == [0, 8, 14]
    assert td["responses"].values().tolist() == list(range(100, 108)) + list(range(6))
    assert td["rm_scores"].values().eq(0.5).all() and td["uid"] == ["u100", "u0"]
    assert td.get("uid").tolist() == ["u100", "u0"]  # a NonTensorStack, as verl pops it


def test_put_returns_merged_stored_tags_and_the_fields_every_row_holds(store: dataplane.DataPlaneClient) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", tags=[{"min_global_steps": 1}, {"min_global_steps": 2}])
    tq.kv_batch_put(keys=["a"], partition_id="p", fields=TensorDict({"x": torch.ones(1, 3)}, batch_size=[1]))
    meta = tq.kv_batch_put(
        keys=["b", "a"],
        partition_id="p",
        fields=TensorDict({"y": torch.zeros(2)}, batch_size=[2]),
        tags=[{"seq_len": 4}, {}],
    )
    assert isinstance(meta, KVBatchMeta) and meta.keys == ["b", "a"] and meta.partition_id == "p"
    assert meta.tags == [{"min_global_steps": 2, "seq_len": 4}, {"min_global_steps": 1}]
    assert meta.fields == ["y"]  # "x" is held by one row only
    assert meta.extra_info == {}
    plain = pickle.loads(pickle.dumps(meta))  # as verl ships it to its workers
    assert type(plain) is KVBatchMeta and plain == meta and copy.deepcopy(meta) == meta


def test_gets_drop_missing_keys_and_fields_or_raise_as_transfer_queue(
    store: dataplane.DataPlaneClient, caplog: pytest.LogCaptureFixture
) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    tq.kv_batch_put(keys=["a"], partition_id="p", fields=TensorDict({"y": torch.ones(1, 2)}, batch_size=[1]))
    with caplog.at_level(logging.WARNING):
        td = tq.kv_batch_get(keys=["b", "gone", "a"], partition_id="p", select_fields=["x", "y", "values"])
    assert list(td.keys()) == ["x"] and td["x"].tolist() == [1, 0]
    assert "not found" in caplog.text and "dropped" in caplog.text
    assert list(tq.kv_batch_get(keys=["a", "b"], partition_id="p").keys()) == ["x"]  # no select: shared fields
    assert list(tq.kv_batch_get(keys="a", partition_id="p").keys()) == ["x", "y"]
    for nothing in (["y"], []):  # every selected field dropped, or none selected
        empty = tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=nothing)
        assert empty.batch_size == torch.Size([0]) and not list(empty.keys())
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(keys=["gone"], partition_id="p", select_fields="x")
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get(keys=["a"], partition_id="nowhere")
    tq.kv_batch_put(keys=["t"], partition_id="p", tags=[{"is_prompt": True}])
    with pytest.raises(ValueError, match="not ready"):
        tq.kv_batch_get(keys=["t"], partition_id="p")


def test_strict_mode_raises_what_transfer_queue_would_drop(
    store: dataplane.DataPlaneClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tq.STRICT_ENV, "1")
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    with pytest.raises(MissingRows, match="gone") as err:
        tq.kv_batch_get(keys=["a", "gone"], partition_id="p", select_fields="x")
    assert isinstance(err.value, KeyNotFound) and isinstance(err.value, ValueError)
    with pytest.raises(MissingRows, match="'values'"):
        tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=["x", "values"])
    assert tq.kv_batch_get(keys=["b", "a"], partition_id="p", select_fields="x")["x"].tolist() == [1, 0]


def test_kv_put_merges_one_rows_tags_and_makes_tag_only_rows(store: dataplane.DataPlaneClient) -> None:
    tq.kv_batch_put(
        keys=["u1", "u2"], partition_id="train", tags=[{"is_prompt": True, "status": "pending", "global_steps": 3}] * 2
    )

    async def flip() -> None:
        await tq.async_kv_put(key="u1", partition_id="train", tag={"status": "running"})
        await tq.async_kv_put(key="new", partition_id="train", tag={"status": "finished"})

    asyncio.run(flip())
    meta = tq.kv_put(key="u2", partition_id="train", fields={"ids": torch.arange(4), "note": "hi"})
    assert meta.fields == ["ids", "note"] and meta.tags == [{"is_prompt": True, "status": "pending", "global_steps": 3}]
    listing = tq.kv_list("train")["train"]
    assert list(listing) == ["u1", "u2", "new"]
    assert listing["u1"] == {"is_prompt": True, "status": "running", "global_steps": 3}
    td = tq.kv_batch_get(keys=["u2"], partition_id="train")
    assert td["ids"].offsets().tolist() == [0, 4] and td["note"] == ["hi"]
    assert tq.kv_list("elsewhere") == {}
    tq.kv_clear(keys=["u1", "new", "never"], partition_id="train")
    assert list(tq.kv_list()["train"]) == ["u2"]
    with pytest.raises(ValueError):
        tq.kv_clear(keys=[], partition_id="train")
    with pytest.raises(ValueError):
        tq.kv_batch_put(keys=["z"], partition_id="train")


def test_tags_with_numpy_and_torch_scalars_are_stored_as_python_values(store: dataplane.DataPlaneClient) -> None:
    import numpy as np

    meta = tq.kv_batch_put(
        keys=["a"], partition_id="p", tags=[{"n": np.int64(3), "r": torch.tensor(0.5), "l": (np.float32(1.5),)}]
    )
    assert meta.tags == [{"n": 3, "r": 0.5, "l": [1.5]}] and type(meta.tags[0]["n"]) is int


def test_worker_client_reads_and_writes_by_batch_meta(store: dataplane.DataPlaneClient) -> None:
    """The path of verl's ``tqbridge``: retrieve a meta, chunk it, read each chunk, write back, concat."""
    tq.kv_batch_put(
        keys=[f"k{i}" for i in range(5)], partition_id="p", fields=_rollout([4] * 5), tags=[{"i": i} for i in range(5)]
    )
    client = tq.get_client()

    async def run() -> BatchMeta:
        meta = await client.async_kv_retrieve_meta(keys=["k3", "k0", "k4", "gone", "k1", "k2"], partition_id="p")
        assert meta.global_indexes == ["k3", "k0", "k4", "k1", "k2"] and [t["i"] for t in meta.custom_meta] == [
            3,
            0,
            4,
            1,
            2,
        ]
        meta = meta.select_fields(["responses", "not_there"])
        assert meta.field_names == ["responses"]
        outs = []
        for part in meta.chunk(2):
            td = await client.async_get_data(part)
            logp = torch.nested.nested_tensor_from_jagged(
                td["responses"].values().float() * -1, td["responses"].offsets()
            )
            outs.append(
                await client.async_put(data=TensorDict({"log_probs": logp}, batch_size=[part.size]), metadata=part)
            )
        assert [m.size for m in outs] == [3, 2] and outs[0].field_names == ["log_probs", "responses"]
        merged = BatchMeta.concat([*outs, BatchMeta()])
        assert (
            await client.async_kv_retrieve_keys(global_indexes=merged.global_indexes, partition_id="p")
            == merged.global_indexes
        )
        return merged

    merged = asyncio.run(run())
    td = tq.kv_batch_get(keys=merged.global_indexes, partition_id="p", select_fields=["log_probs", "responses"])
    assert torch.equal(td["log_probs"].values(), -td["responses"].values().float())


def test_kv_batch_meta_is_mutable_as_verl_uses_it() -> None:
    meta = KVBatchMeta(keys=["a", "b", "c"], tags=[{"i": 0}, {"i": 1}, {"i": 2}], partition_id="p", fields=["x"])
    meta.reorder([2, 0, 1])
    assert meta.keys == ["c", "a", "b"] and [t["i"] for t in meta.tags] == [2, 0, 1]
    padded = KVBatchMeta(keys=meta.keys + ["pad"], tags=meta.tags + [{"is_padding": True}], partition_id="p")  # noqa: RUF005 - as verl does
    assert len(padded) == 4 and padded.size == 4
    meta.extra_info.update({"temperature": 1.0})
    a, b = meta.chunk(2)
    assert (a.keys, b.keys) == (["c", "a"], ["b"]) and a.extra_info == {"temperature": 1.0}
    assert KVBatchMeta.concat([a, KVBatchMeta(), b]) == meta
    assert meta.select_keys(["b", "c"]).tags == [{"i": 1}, {"i": 2}]
    for bad in (lambda: meta.reorder([0, 0, 1]), lambda: KVBatchMeta(keys=["a", "a"], tags=[{}, {}])):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        KVBatchMeta.concat([a, KVBatchMeta(keys=["z"], tags=[{}], partition_id="q")])
    tags = [{"i": 0}]
    kept = KVBatchMeta(keys=["a"], tags=tags)
    tags[0]["i"] = 5
    assert kept.tags == [{"i": 0}]  # the meta deep-copied its tags


def test_checkpoint_restores_rows_tags_order_and_fields_into_another_store(
    store: dataplane.DataPlaneClient, tmp_path: Path
) -> None:
    tq.kv_batch_put(keys=["p1", "p2"], partition_id="train", tags=[{"is_prompt": True, "status": "pending"}] * 2)
    tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=_rollout([6, 6]), tags=[{"seq_len": 6}] * 2)
    tq.kv_batch_put(keys=["c"], partition_id="train", fields=_rollout([3], start=50), tags=[{"seq_len": 3}])
    tq.kv_batch_put(keys=["a"], partition_id="train", fields=TensorDict({"adv": torch.ones(1)}, batch_size=[1]))
    tq.kv_batch_put(keys=["v"], partition_id="val", fields=TensorDict({"r": torch.ones(1)}, batch_size=[1]))
    before = tq.kv_list()
    reads = {k: tq.kv_batch_get(keys=k, partition_id="train") for k in ["a", "b", "c"]}
    tq.save_checkpoint(str(tmp_path / "ckpt"), metadata={"global_steps": 7})
    tq.save_checkpoint(str(tmp_path / "ckpt"), metadata={"global_steps": 8})  # swapped in over the first
    assert not (tmp_path / "ckpt.tmp").exists() and not (tmp_path / "ckpt.old").exists()
    with dataplane.connect() as fresh:  # another store, already holding something the load replaces
        tq._adopt(fresh)
        tq.kv_batch_put(keys=["stale"], partition_id="gone", tags=[{}])
        assert tq.load_checkpoint(str(tmp_path / "ckpt")) == {"global_steps": 8}
        assert tq.kv_list() == before and list(tq.kv_list()["train"]) == list(before["train"])
        for k, want in reads.items():
            got = tq.kv_batch_get(keys=k, partition_id="train")
            assert list(got.keys()) == list(want.keys())
            for f in want.keys():
                a, b = got.get(f), want.get(f)
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a.values(), b.values()) if a.is_nested else torch.equal(a, b)
                else:
                    assert a.tolist() == b.tolist()
        with pytest.raises(FileNotFoundError):
            tq.load_checkpoint(str(tmp_path / "nothing"))
