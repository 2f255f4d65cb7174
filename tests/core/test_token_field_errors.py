"""One mistake, one error class: a per-token field given as a 1-D tensor is a ``SchemaError``
(a ``TypeError``: a tensor of the wrong rank for a per-token field, a shape and kind mistake) from
every entry point that takes per-token fields, and nothing is written."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.codec import pack
from dataplane.columns import first_write, write_columns
from dataplane.errors import SchemaError
from dataplane.meta import KVBatchMeta
from dataplane.worker import DataPlaneWorkerMixin
from dataplane.worker.writeback import prepare_writeback

LENGTHS = (2, 3, 1)


class _Worker(DataPlaneWorkerMixin):
    pass


@pytest.fixture
def written() -> Iterator[tuple[DataPlaneClient, KVBatchMeta]]:
    client = dataplane.connect("memory://")
    rows = [torch.arange(n) for n in LENGTHS]
    meta = client.kv_batch_put(
        ["a", "b", "c"], {"ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, partition_id="p"
    )
    assert meta.sequence_lengths == LENGTHS
    yield client, meta
    client.close()


def _write_back(client: DataPlaneClient, meta: KVBatchMeta, value: torch.Tensor) -> object:
    worker = _Worker()
    worker.setup_data_plane(client)
    return worker.write_back(meta, {"lp": value}, token_fields=["lp"])


def _prepare_writeback(client: DataPlaneClient, meta: KVBatchMeta, value: torch.Tensor) -> object:
    return prepare_writeback(meta, {"lp": value}, token_fields=["lp"])


def _write_columns(client: DataPlaneClient, meta: KVBatchMeta, value: torch.Tensor) -> object:
    return write_columns(client, meta, {"lp": value}, token_fields=["lp"])


def _first_write(client: DataPlaneClient, meta: KVBatchMeta, value: torch.Tensor) -> object:
    return first_write(
        client,
        {"lp": value},
        uids=["u0", "u1", "u2"],
        group_size=1,
        partition_id="p",
        token_fields=["lp"],
        lengths=LENGTHS,
    )


def _pack(client: DataPlaneClient, meta: KVBatchMeta, value: torch.Tensor) -> object:
    return pack(value, LENGTHS)


ENTRY_POINTS: dict[str, Callable[[DataPlaneClient, KVBatchMeta, torch.Tensor], object]] = {
    "worker.write_back": _write_back,
    "worker.prepare_writeback": _prepare_writeback,
    "columns.write_columns": _write_columns,
    "columns.first_write": _first_write,
    "codec.pack": _pack,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_one_dimensional_per_token_field_is_a_schema_error(
    written: tuple[DataPlaneClient, KVBatchMeta], entry: str
) -> None:
    client, meta = written
    with pytest.raises(SchemaError, match=r"\[B, W") as caught:
        ENTRY_POINTS[entry](client, meta, torch.zeros(len(LENGTHS)))
    assert isinstance(caught.value, TypeError) and not isinstance(caught.value, ValueError)
    assert set(client.kv_list("p")["p"]) == {"a", "b", "c"}  # nothing new written
    with pytest.raises(KeyError):
        client.kv_batch_get(meta, select_fields="lp")
