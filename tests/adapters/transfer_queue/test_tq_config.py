"""``tq://`` options: URL parsing and the config object (no Ray or TransferQueue needed)."""

from __future__ import annotations

import pickle

import pytest

from dataplane.adapters.transfer_queue import TQConfig
from dataplane.errors import InvalidArgument
from dataplane.registry import _scheme_of


def test_url_options_map_to_the_config() -> None:
    cfg = TQConfig.from_url("tq://?backend=simple&units=2&capacity_rows=1e4&timeout_s=5&num_cpus=6&pickle_fields=a,b")
    assert (cfg.backend, cfg.units, cfg.capacity_rows, cfg.timeout_s, cfg.num_cpus) == ("simple", 2, 10000, 5.0, 6)
    assert cfg.pickle_fields == ("a", "b")
    dep = cfg.deploy_config()
    assert (dep.storage, dep.attach_only, dep.num_storage_units, dep.storage_capacity_rows) == (
        "simple",
        False,
        2,
        10000,
    )
    assert dep.op_timeout_s == 5.0


def test_attach_only_and_ray_address() -> None:
    cfg = TQConfig.from_url("tq://10.0.0.5:6379")
    assert cfg.backend is None and cfg.ray_address == "10.0.0.5:6379" and cfg.deploy_config().attach_only
    m = TQConfig.from_url(f"tq://?backend=mooncake&segment_bytes={64 << 20}&master=127.0.0.1:5000")
    dep = m.deploy_config()
    assert (dep.storage, dep.mooncake_segment_bytes, dep.mooncake_master_address) == (
        "mooncake",
        64 << 20,
        "127.0.0.1:5000",
    )


@pytest.mark.parametrize(
    "url",
    [
        "tq://?backend=redis",
        "tq://?bogus=1",
        "tq://?timeout_s=0",
        "tq://?backend=mooncake&capacity_rows=10",
        "tq://?units=two",
        "tq://?init_timeout_s=soon",
        "memory://",
    ],
)
def test_bad_options_raise(url: str) -> None:
    with pytest.raises(InvalidArgument):
        TQConfig.from_url(url)


def test_config_object_is_a_frozen_picklable_value_the_registry_routes() -> None:
    cfg = TQConfig(backend="mooncake", segment_bytes=1 << 28)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert _scheme_of(cfg) == "tq"
    with pytest.raises(AttributeError):
        cfg.units = 3  # type: ignore[misc]
