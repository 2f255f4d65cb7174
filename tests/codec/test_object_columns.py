"""Per-row object columns given as a numpy object array of shape ``(B,)``, bare or in a TensorDict
(which wraps it as one ``NonTensorData``), are object columns like lists: they round-trip, and come
back as what a list column comes back as -- a ``NonTensorStack`` whose ``td[field]`` is a plain list."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.columns import first_write, read_columns, write_columns
from dataplane.errors import InvalidArgument, SchemaError
from dataplane.worker import DataPlaneWorkerMixin

ROWS: list[Any] = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "ground truth",
    {"score": 1.5, "ids": [1, 2, 3], "note": None},
]
KEYS = ["a", "b", "c"]


def _object_array(rows: list[Any]) -> np.ndarray:
    arr = np.empty(len(rows), dtype=object)  # np.array(rows) would make a 2-D array of equal-length lists
    arr[:] = rows
    return arr


@pytest.fixture
def client() -> Iterator[DataPlaneClient]:
    c = dataplane.connect("memory://")
    yield c
    c.close()


def _as_list_column_reads(client: DataPlaneClient) -> Any:
    client.kv_batch_put(KEYS, {"o": list(ROWS)}, partition_id="lists")
    return client.kv_batch_get(KEYS, partition_id="lists", select_fields="o")


@pytest.mark.parametrize("container", ["dict", "tensordict"])
def test_object_ndarray_round_trips_as_a_list_column_does(client: DataPlaneClient, container: str) -> None:
    arr = _object_array(ROWS)
    fields: Any = {"o": arr, "r": torch.arange(3.0)}
    if container == "tensordict":
        fields = TensorDict(fields, batch_size=[3])
        assert isinstance(fields.get("o"), NonTensorData)  # how tensordict holds it: one value
    meta = client.kv_batch_put(KEYS, fields, partition_id="p")
    assert meta.fields == ("o", "r")
    got = client.kv_batch_get(meta, select_fields=["o", "r"])
    want = _as_list_column_reads(client)
    assert isinstance(got.get("o"), NonTensorStack) and type(got.get("o")) is type(want.get("o"))
    assert got.get("o").tolist() == want.get("o").tolist() == ROWS
    assert got["o"] == want["o"] == ROWS and type(got["o"]) is list and type(want["o"]) is list
    assert torch.equal(got["r"], torch.arange(3.0))


def test_object_ndarray_elements_follow_the_rules_of_list_elements(client: DataPlaneClient) -> None:
    client.kv_batch_put(KEYS, TensorDict({"o": _object_array([(1, 2), b"x", 7])}, batch_size=[3]), partition_id="p")
    assert client.kv_batch_get(KEYS, partition_id="p", select_fields="o")["o"] == [[1, 2], b"x", 7]  # msgpack's types
    for rows in ([1, np.int64(7), 2], _object_array([1, np.int64(7), 2])):  # a numpy scalar is no msgpack type
        with pytest.raises(SchemaError, match="row 1: int64 cannot be encoded"):
            client.kv_batch_put(KEYS, {"o": rows}, partition_id="q")


def test_object_ndarray_through_the_column_helpers_and_write_back(client: DataPlaneClient) -> None:
    ids = torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 1]])
    rollout = TensorDict({"input_ids": ids, "prompt": _object_array(ROWS)}, batch_size=[3])
    meta = first_write(
        client,
        rollout,
        uids=["u0", "u1", "u2"],
        group_size=1,
        partition_id="p",
        token_fields=["input_ids"],
        lengths=[2, 1, 3],
    )
    write_columns(client, meta, TensorDict({"answer": _object_array(ROWS[::-1])}, batch_size=[3]))
    worker = DataPlaneWorkerMixin()
    worker.setup_data_plane(client)
    worker.write_back(meta, TensorDict({"judge": _object_array(ROWS[1:] + ROWS[:1])}, batch_size=[3]))
    back = read_columns(client, meta, ["prompt", "answer", "judge"])
    assert back["prompt"] == ROWS and back["answer"] == ROWS[::-1] and back["judge"] == ROWS[1:] + ROWS[:1]


def test_wrong_length_object_ndarray_and_batch_level_values_are_still_rejected(client: DataPlaneClient) -> None:
    with pytest.raises(InvalidArgument, match="2 rows but 3 keys"):
        client.kv_batch_put(KEYS, {"o": _object_array(ROWS[:2])}, partition_id="p")
    batch_level = TensorDict({"o": "one value for the batch"}, batch_size=[3])
    with pytest.raises(SchemaError, match="extra_info"):
        client.kv_batch_put(KEYS, batch_level, partition_id="p")
    assert client.kv_list("p") == {}
