"""Every built-in backend rejects an unknown option, in the URL or as a keyword, with one typed error
that lists the valid options; nothing is started before the check. Every byte-count option of every
backend takes one size syntax (``67108864``, ``"64MiB"``, ``"1GB"``) and refuses anything else alike."""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import quote

import pytest
import torch

import dataplane
from dataplane.adapters.memory import MemoryConfig
from dataplane.adapters.mooncake import MooncakeConfig
from dataplane.adapters.transfer_queue import TQConfig
from dataplane.checks import SIZE_EXAMPLES
from dataplane.registry import check_options

CONFIGS: dict[str, tuple[type[Any], str]] = {
    "memory": (MemoryConfig, "memory://"),
    "mooncake": (MooncakeConfig, "mooncake://local"),
    "tq": (TQConfig, "tq://?backend=simple"),
}


def _valid(config: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


@pytest.mark.parametrize("scheme", sorted(CONFIGS))
@pytest.mark.parametrize("how", ["url", "keyword", "config_and_keyword"])
def test_unknown_option_is_invalid_argument_listing_the_valid_ones(scheme: str, how: str) -> None:
    config, url = CONFIGS[scheme]
    typo = "timeout_sec"  # every backend has timeout_s
    with pytest.raises(dataplane.InvalidArgument) as err:
        if how == "url":
            sep = "&" if "?" in url else "?"
            dataplane.connect(f"{url}{sep}{typo}=5")
        elif how == "keyword":
            dataplane.connect(url, **{typo: 5})
        else:
            dataplane.connect(config.from_url(url), **{typo: 5})
    message = str(err.value)
    assert f"unknown {scheme}:// " in message and repr(typo) in message, message
    listed = message.split("valid options: ", 1)[1].split(", ")
    assert "timeout_s" in listed and "scheme" not in listed and typo not in listed, message
    assert set(listed) <= set(_valid(config)), message


@pytest.mark.parametrize("scheme", sorted(CONFIGS))
def test_valid_keywords_and_config_objects_are_taken(scheme: str) -> None:
    config, url = CONFIGS[scheme]
    cfg = config.from_url(url, timeout_s=7.5)
    assert cfg.timeout_s == 7.5
    assert dataclasses.replace(cfg, timeout_s=3.0).timeout_s == 3.0


def test_check_options_names_every_unknown_option_once() -> None:
    check_options("x", ["a"], ["a", "b"])  # known: no error
    with pytest.raises(dataplane.InvalidArgument, match=r"unknown x:// keywords 'c', 'd'; valid options: a, b$"):
        check_options("x", ["c", "a", "d"], ["b", "a"], how="keyword")


def test_a_keyword_overrides_what_the_url_host_says() -> None:
    """Keywords win over the URL, for its host part as for its query (was a TypeError for the host)."""
    assert MemoryConfig.from_url("memory://a", name="b").name == "b"
    assert MooncakeConfig.from_url("mooncake://local", master="127.0.0.1:1").master == "127.0.0.1:1"
    assert TQConfig.from_url("tq://host:6379", ray_address="auto").ray_address == "auto"


# -- sizes ------------------------------------------------------------------------------------------
# every byte-count option of every built-in backend, with a URL (and config keywords) it is valid in
BYTE_OPTIONS: list[tuple[type[Any], str, dict[str, Any], str]] = [
    (MemoryConfig, "memory://", {}, "capacity_bytes"),
    (MooncakeConfig, "mooncake://local?shm=false", {"shm": False}, "segment_bytes"),
    (MooncakeConfig, "mooncake://local?shm=false", {"shm": False}, "client_segment_bytes"),
    (MooncakeConfig, "mooncake://local?shm=false", {"shm": False}, "local_buffer_bytes"),
    (MooncakeConfig, "mooncake://local?shm=false", {"shm": False}, "pool_bytes"),
    (TQConfig, "tq://?backend=mooncake", {"backend": "mooncake"}, "segment_bytes"),
    (TQConfig, "tq://?backend=mooncake", {"backend": "mooncake"}, "worker_segment_bytes"),
]
SIZES: list[tuple[Any, int]] = [
    ("67108864", 64 << 20),
    (67108864, 64 << 20),
    ("64MiB", 64 << 20),
    ("64MB", 64 << 20),  # binary either way, as Mooncake reads sizes
    ("64mb", 64 << 20),
    ("64 M", 64 << 20),
    ("1GiB", 1 << 30),
    ("1GB", 1 << 30),
    ("1.5GiB", 3 << 29),
    ("512KiB", 512 << 10),
    ("4096B", 4096),
    ("1e9", 10**9),
]
NOT_SIZES: list[Any] = ["64 parsecs", "-1", "1.2.3MiB", "MiB", "1e400", True, -5]


def _ids(case: tuple[type[Any], str, dict[str, Any], str]) -> str:
    return f"{case[1].split(':')[0]}-{case[3]}"


@pytest.mark.parametrize("case", BYTE_OPTIONS, ids=_ids)
def test_every_byte_option_parses_every_size_alike(case: tuple[type[Any], str, dict[str, Any], str]) -> None:
    """One size syntax for every byte option of every backend, by URL, keyword or config object."""
    config, url, base, option = case
    sep = "&" if "?" in url else "?"
    for given, want in SIZES:
        via_url = config.from_url(f"{url}{sep}{option}={quote(str(given))}")
        via_keyword = config.from_url(url, **{option: given})
        via_config = config(**base, **{option: given})
        assert getattr(via_url, option) == getattr(via_keyword, option) == getattr(via_config, option) == want, given
        assert type(getattr(via_config, option)) is int


@pytest.mark.parametrize("case", BYTE_OPTIONS, ids=_ids)
def test_every_byte_option_refuses_a_non_size_with_one_message(
    case: tuple[type[Any], str, dict[str, Any], str],
) -> None:
    config, url, base, option = case
    for bad in NOT_SIZES:
        with pytest.raises(dataplane.InvalidArgument) as err:
            config.from_url(url, **{option: bad})
        message = str(err.value).replace(" or None", "")  # capacity_bytes may be None: unbounded
        assert message == f"{option} must be a size in bytes >= 0 ({SIZE_EXAMPLES}), got {bad!r}"
        with pytest.raises(dataplane.InvalidArgument, match=f"^{option} must be a size in bytes"):
            config(**base, **{option: bad})
    sep = "&" if "?" in url else "?"
    with pytest.raises(dataplane.InvalidArgument, match=f"^{option} must be a size in bytes"):
        config.from_url(f"{url}{sep}{option}=lots")


def test_a_memory_store_holds_what_a_size_says() -> None:
    with dataplane.connect("memory://?capacity_bytes=4KiB") as client:
        client.kv_batch_put(["a"], {"x": torch.zeros(1024)[None]}, partition_id="p")  # 4096 bytes: fits
        with pytest.raises(dataplane.CapacityExceeded):
            client.kv_batch_put(["b"], {"x": torch.zeros(1, 1024)}, partition_id="p")
