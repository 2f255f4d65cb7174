"""Adapters by URL scheme: built-ins plus third-party ones from the ``dataplane.adapters`` entry points.

An entry point's name is the URL scheme; its value is a callable ``connect(url_or_config, **options)``
returning a :class:`dataplane.client.DataPlaneClient`. Nothing is imported until it is used, and a
broken plugin warns instead of breaking ``import dataplane``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from dataplane.client import DataPlaneClient
from dataplane.errors import BackendUnavailable, InvalidArgument

_T = TypeVar("_T")

log = logging.getLogger(__name__)

__all__ = [
    "URL_ENV",
    "AdapterSpec",
    "available_adapters",
    "check_options",
    "connect",
    "export_url",
    "register_adapter",
    "url_bool",
    "url_option",
]

ENTRY_POINT_GROUP = "dataplane.adapters"
URL_ENV = "DATAPLANE_URL"
"""What ``dataplane.connect()`` with no argument connects to. A client that started a deployment
exports its ``url`` here (when unset), so the processes it starts afterwards join with ``connect()``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSpec:
    """Where an adapter lives and what it needs.

    Attributes:
        scheme: URL scheme (``memory``, ``tq``, ``mooncake``).
        target: ``"module:function"`` of its connect function.
        requires: top-level modules that must be importable.
        extra: the pip extra that installs them.
    """

    scheme: str
    target: str
    requires: tuple[str, ...] = ()
    extra: str | None = None

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]

    def load(self) -> Callable[..., DataPlaneClient]:
        missing = self.missing()
        if missing:
            hint = f"pip install 'dataplane[{self.extra}]'" if self.extra else f"install {', '.join(missing)}"
            raise BackendUnavailable(
                f"the {self.scheme}:// adapter needs {', '.join(missing)}, which is not installed; run: {hint}"
            )
        module, _, attr = self.target.partition(":")
        fn: Callable[..., DataPlaneClient] = getattr(importlib.import_module(module), attr)
        return fn


_BUILTIN = {
    spec.scheme: spec
    for spec in (
        AdapterSpec(scheme="memory", target="dataplane.adapters.memory:connect"),
        AdapterSpec(
            scheme="tq",
            target="dataplane.adapters.transfer_queue:connect",
            requires=("transfer_queue", "ray"),
            extra="tq",
        ),
        AdapterSpec(
            scheme="mooncake",
            target="dataplane.adapters.mooncake:connect",
            requires=("mooncake",),
            extra="mooncake",
        ),
    )
}
_REGISTERED: dict[str, AdapterSpec | Callable[..., DataPlaneClient]] = {}


def register_adapter(scheme: str, connect_fn: Callable[..., DataPlaneClient]) -> None:
    """Register an adapter at run time (the entry-point group does the same for installed packages)."""
    _REGISTERED[scheme] = connect_fn


def _plugins() -> dict[str, Callable[..., DataPlaneClient]]:
    found: dict[str, Callable[..., DataPlaneClient]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTIN:
            continue

        def _lazy(*args: Any, _ep: Any = ep, **kwargs: Any) -> DataPlaneClient:
            fn: Callable[..., DataPlaneClient] = _ep.load()
            return fn(*args, **kwargs)

        found[ep.name] = _lazy
    return found


def available_adapters() -> dict[str, bool]:
    """Scheme -> whether its backend is installed here."""
    out = {s: not spec.missing() for s, spec in _BUILTIN.items()}
    try:
        out.update({s: True for s in _plugins()})
    except Exception as e:  # a broken plugin must not break dataplane
        warnings.warn(f"dataplane: could not read {ENTRY_POINT_GROUP} entry points: {e}", stacklevel=2)
    out.update({s: True for s in _REGISTERED})
    return out


def url_bool(raw: str) -> bool:
    """A URL flag: 1/0, true/false, yes/no (any case); anything else is a ``ValueError``."""
    value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(raw.lower())
    if value is None:
        raise ValueError(f"expected true or false, got {raw!r}")
    return value


def url_option(url: str, key: str, raw: str, convert: Callable[[str], _T]) -> _T:
    """``convert(raw)`` for the query option ``key`` of ``url``; a value it rejects is an ``InvalidArgument``."""
    try:
        return convert(raw)
    except (ValueError, OverflowError) as e:
        raise InvalidArgument(f"option {key}={raw!r} of {url!r} is not valid: {e}") from None


def check_options(scheme: str, given: Iterable[str], known: Iterable[str], *, how: str = "option") -> None:
    """Raise ``InvalidArgument`` naming every option of ``given`` that is not in ``known``, and listing
    the valid ones: one message for an unknown URL query parameter and an unknown keyword alike.

    >>> check_options("memory", ["capacity_byte"], ["capacity_bytes", "name"])
    Traceback (most recent call last):
    ...
    dataplane.errors.InvalidArgument: unknown memory:// option 'capacity_byte'; valid options: capacity_bytes, name
    """
    valid = sorted(set(known))
    unknown = [k for k in given if k not in valid]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise InvalidArgument(f"unknown {scheme}:// {how}{plural} {names}; valid options: {', '.join(valid)}")


def _scheme_of(url_or_config: Any) -> str:
    if url_or_config is None:
        return "memory"
    if isinstance(url_or_config, str):
        scheme, sep, _ = url_or_config.partition("://")
        if not sep or not scheme:
            raise InvalidArgument(f"expected a URL like 'memory://' or 'tq://?backend=simple', got {url_or_config!r}")
        return scheme
    declared = getattr(url_or_config, "scheme", None)
    if isinstance(declared, str):
        return declared
    module = type(url_or_config).__module__
    for spec in _BUILTIN.values():
        if spec.target.partition(":")[0] == module:
            return spec.scheme
    raise InvalidArgument(f"cannot tell which adapter {type(url_or_config).__name__} configures; pass a URL")


def export_url(url: str) -> Callable[[], None]:
    """Set ``$DATAPLANE_URL`` to ``url`` when it is unset (an owner announcing the deployment it
    started); returns the undo, which removes it only while it still holds ``url``."""
    if not url or os.environ.get(URL_ENV):
        return lambda: None
    os.environ[URL_ENV] = url
    log.debug("dataplane: exported %s=%s", URL_ENV, url)

    def undo() -> None:
        if os.environ.get(URL_ENV) == url:
            del os.environ[URL_ENV]

    return undo


def connect(url_or_config: Any = None, **options: Any) -> DataPlaneClient:
    """Open a client for a URL or adapter config object.

    With no URL it joins ``$DATAPLANE_URL`` when that is set (the owner of a deployment exports it
    to the processes it starts: ``client.url``), else it gives a private memory store.

    >>> with connect("memory://") as client:
    ...     client.capabilities.backend
    'memory'
    """
    if url_or_config is None:
        url_or_config = os.environ.get(URL_ENV) or None
    scheme = _scheme_of(url_or_config)
    registered = _REGISTERED.get(scheme)
    if registered is not None:
        fn = registered.load() if isinstance(registered, AdapterSpec) else registered
        return fn(url_or_config, **options)
    if scheme in _BUILTIN:
        return _BUILTIN[scheme].load()(url_or_config, **options)
    try:
        plugins = _plugins()
    except Exception as e:
        warnings.warn(f"dataplane: could not read {ENTRY_POINT_GROUP} entry points: {e}", stacklevel=2)
        plugins = {}
    if scheme in plugins:
        return plugins[scheme](url_or_config, **options)
    known = sorted(set(_BUILTIN) | set(_REGISTERED) | set(plugins))
    raise InvalidArgument(
        f"no adapter for scheme {scheme!r}; known: {known}. Third-party adapters register under the "
        f"{ENTRY_POINT_GROUP!r} entry-point group"
    )
