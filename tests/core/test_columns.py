"""Column helpers against a real memory client: first write, padded reads, checked write-back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.columns import first_write, read_columns, write_columns
from dataplane.errors import InvalidArgument, KeyNotFound, SchemaError
from dataplane.preshard import restore_order, shard_meta_for_dp


@pytest.fixture
def client() -> Iterator[DataPlaneClient]:
    with dataplane.connect() as c:
        yield c


def rollout(lengths: list[int], multiple: int = 1, pad_id: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded token fields of width round_up(max length, multiple), plus per-row scalars."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    width = -(-max(lengths, default=0) // multiple) * multiple
    lens = torch.tensor(lengths, dtype=torch.int64)
    mask = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)
    ids = torch.randint(1, 50_000, (n, width), generator=g).masked_fill(~mask, pad_id)
    logp = torch.randn(n, width, generator=g).masked_fill(~mask, 0.0).to(torch.bfloat16)
    hidden = torch.randn(n, width, 2, generator=g).masked_fill(~mask.unsqueeze(-1), 0.0)
    return {
        "input_ids": ids,
        "attention_mask": mask.to(torch.int64),
        "old_logprobs": logp,
        "hidden": hidden,
        "reward": torch.randn(n, generator=g),
    }


TOKEN_FIELDS = ["input_ids", "old_logprobs", "hidden"]


@given(
    st.integers(1, 4).flatmap(
        lambda g: st.tuples(st.just(g), st.lists(st.integers(0, 40), min_size=g, max_size=6 * g))
    ),
    st.sampled_from([1, 8]),
)
def test_first_write_then_padded_read_is_the_input(case: tuple[int, list[int]], multiple: int) -> None:
    group, lengths = case
    lengths = lengths[: len(lengths) // group * group]
    data = rollout(lengths, multiple, pad_id=7)
    uids = [f"p{i}" for i in range(len(lengths) // group)]
    with dataplane.connect() as c:
        meta = first_write(
            c,
            data,
            uids=uids,
            group_size=group,
            partition_id="train",
            token_fields=TOKEN_FIELDS,
            pad_to_multiple=multiple,
        )
        assert meta.sequence_lengths == tuple(lengths)
        assert meta.keys == tuple(f"{u}_g{i}" for u in uids for i in range(group))
        assert meta.tags == tuple({"uid": u, "sample_idx": i} for u in uids for i in range(group))
        assert meta.extra_info == {"pad_to_multiple": multiple, "group_size": group}
        if max(lengths, default=0) == 0:
            return  # an all-empty batch has width 0 on both sides but no jagged values to compare
        back = read_columns(c, meta, [*TOKEN_FIELDS, "attention_mask", "reward"], pad_values={"input_ids": 7})
        for f, v in data.items():
            assert back[f].dtype == v.dtype and torch.equal(back[f], v), f


def test_lengths_sources(client: DataPlaneClient) -> None:
    data = rollout([3, 1, 0, 2])
    kw = {"uids": ["a", "b"], "group_size": 2, "token_fields": ["input_ids"]}
    m1 = first_write(client, data, partition_id="p1", **kw)  # type: ignore[arg-type]
    m2 = first_write(client, data, partition_id="p2", lengths="attention_mask", **kw)  # type: ignore[arg-type]
    m3 = first_write(client, {**data, "n": torch.tensor([3, 1, 0, 2])}, partition_id="p3", lengths="n", **kw)  # type: ignore[arg-type]
    m4 = first_write(client, data, partition_id="p4", lengths=torch.tensor([3, 1, 0, 2]), **kw)  # type: ignore[arg-type]
    assert m1.sequence_lengths == m2.sequence_lengths == m3.sequence_lengths == m4.sequence_lengths == (3, 1, 0, 2)
    stored = client.kv_batch_get(m1, select_fields="input_ids")["input_ids"]
    assert stored.is_nested and [len(r) for r in stored.unbind()] == [3, 1, 0, 2]


def test_first_write_rejects_before_writing(client: DataPlaneClient) -> None:
    data = rollout([3, 1, 2, 2])
    kw = {"uids": ["a", "b"], "group_size": 2, "partition_id": "p", "token_fields": ["input_ids"]}
    left = data["attention_mask"].flip(1)
    with pytest.raises(InvalidArgument, match="not right-padded"):
        first_write(client, {**data, "attention_mask": left}, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="uid-major"):
        first_write(client, data, **{**kw, "group_size": 3})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="unique"):
        first_write(client, data, **{**kw, "uids": ["a", "a"]})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="need row lengths"):
        first_write(client, {"input_ids": data["input_ids"]}, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="wide"):
        first_write(client, data, lengths=[9, 1, 1, 1], **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not in the rollout"):
        first_write(client, data, **{**kw, "token_fields": ["nope"]})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="tag dicts"):
        first_write(client, data, tags=[{}], **kw)  # type: ignore[arg-type]
    assert client.kv_list() == {}


def test_user_tags_are_kept_beside_uid_and_sample(client: DataPlaneClient) -> None:
    data = rollout([1, 2])
    meta = first_write(
        client, data, uids=[42], group_size=2, partition_id="p", token_fields=["input_ids"], tags={"version": 3}
    )
    assert meta.keys == ("42_g0", "42_g1")
    assert meta.tags == ({"version": 3, "uid": 42, "sample_idx": 0}, {"version": 3, "uid": 42, "sample_idx": 1})
    assert client.kv_list("p")["p"]["42_g1"] == {"version": 3, "uid": 42, "sample_idx": 1}


def test_write_columns_checks_sizes_and_writes_nothing_on_mismatch(client: DataPlaneClient) -> None:
    lengths = [3, 1, 4, 2]
    meta = first_write(
        client, rollout(lengths), uids=["a", "b"], group_size=2, partition_id="p", token_fields=["input_ids"]
    )
    before = client.kv_list("p")
    good = torch.ones(4)
    with pytest.raises(InvalidArgument, match="3 rows but the meta has 4"):
        write_columns(client, meta, {"adv": good, "values": torch.zeros(3)})
    bad_rows = torch.nested.as_nested_tensor([torch.zeros(n) for n in [3, 1, 4, 1]], layout=torch.jagged)
    with pytest.raises(InvalidArgument, match="row 3 has 1 tokens but the row length is 2"):
        write_columns(client, meta, {"adv": good, "token_adv": bad_rows})
    with pytest.raises(InvalidArgument, match="wide"):
        write_columns(client, meta, {"adv": good, "lp": torch.zeros(4, 3)}, token_fields=["lp"])
    with pytest.raises(SchemaError):
        write_columns(client, meta, {"adv": good, "x": torch.tensor(1.0)})
    assert client.kv_list("p") == before
    with pytest.raises(KeyNotFound):
        client.kv_batch_get(meta, select_fields="adv")


def test_write_columns_round_trip(client: DataPlaneClient) -> None:
    lengths = [3, 1, 4, 2]
    meta = first_write(
        client, rollout(lengths), uids=["a", "b"], group_size=2, partition_id="p", token_fields=["input_ids"]
    )
    padded = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    rows = [torch.full((n,), float(i)) for i, n in enumerate(lengths)]
    out = write_columns(
        client,
        meta,
        {"adv": torch.ones(4), "lp": padded, "vals": torch.nested.as_nested_tensor(rows, layout=torch.jagged)},
        token_fields=["lp", "vals"],
    )
    assert out.fields == (*meta.fields, "adv", "lp", "vals")
    back = read_columns(client, out, ["adv", "lp", "vals"], pad_values=-1.0)
    mask = torch.arange(4).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    assert torch.equal(back["lp"], padded.masked_fill(~mask, -1.0))
    assert torch.equal(back["vals"][2], torch.full((4,), 2.0))


def test_preshard_then_read_uses_the_global_pad_length(client: DataPlaneClient) -> None:
    lengths = [5, 17, 2, 9, 30, 1, 12, 3]
    data = rollout(lengths, multiple=8)
    meta = first_write(
        client,
        data,
        uids=[f"u{i}" for i in range(4)],
        group_size=2,
        partition_id="p",
        token_fields=["input_ids"],
        pad_to_multiple=8,
    )
    shards = shard_meta_for_dp(meta, 3, max_tokens_per_microbatch=32)  # pad_to_multiple=8 comes from the meta
    widths = set()
    outs = []
    for s in shards:
        td = read_columns(client, s, ["input_ids", "reward"])
        widths.add(td["input_ids"].shape[1])
        outs.append(td)
        write_columns(client, s, {"score": td["reward"] * 2})
    assert widths == {32}
    restored = restore_order([td["input_ids"] for td in outs], shards)
    assert torch.equal(restored, data["input_ids"])
    scores = client.kv_batch_get(meta, select_fields="score")["score"]
    assert torch.equal(scores, data["reward"] * 2)


def test_first_write_takes_a_tensordict_with_object_columns(client: DataPlaneClient) -> None:
    data = rollout([2, 3])
    td = TensorDict(data, batch_size=[2])
    msgs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    meta = first_write(client, td, uids=["q"], group_size=2, partition_id="p", token_fields=["input_ids"])
    write_columns(client, meta, {"messages": msgs})
    back = read_columns(client, meta, ["input_ids", "messages"])
    assert torch.equal(back["input_ids"], data["input_ids"])
    assert back["messages"] == msgs and type(back["messages"]) is list
    nested = TensorDict({"a": TensorDict({"b": torch.zeros(2)}, batch_size=[2])}, batch_size=[2])
    with pytest.raises(SchemaError, match="flatten"):
        write_columns(client, meta, nested)
