"""Every built-in backend rejects an unknown option, in the URL or as a keyword, with one typed error
that lists the valid options; nothing is started before the check."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import dataplane
from dataplane.adapters.memory import MemoryConfig
from dataplane.adapters.mooncake import MooncakeConfig
from dataplane.adapters.transfer_queue import TQConfig
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
