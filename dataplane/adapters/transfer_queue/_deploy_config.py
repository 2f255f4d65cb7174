"""How to find or start TransferQueue (:class:`TQDeployConfig`), and what that means for TQ: the
environment it reads at import (:func:`tq_env`, :func:`apply_env`) and the config ``tq.init`` takes
(:func:`build_conf`). Nothing here talks to Ray or TQ; :mod:`._deployment` does."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CONTROLLER_NAME",
    "STORAGE_UNIT_NAME",
    "TQ_NAMESPACE",
    "TQDeployConfig",
    "apply_env",
    "build_conf",
    "tq_env",
    "units_in",
]

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "TransferQueueController"
TQ_NAMESPACE = "transfer_queue"
STORAGE_UNIT_NAME = "TransferQueueStorageUnit#{}"

_GIB = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class TQDeployConfig:
    """How to find or start TransferQueue.

    Attributes:
        storage: ``"simple"`` (TQ's SimpleStorage actors) or ``"mooncake"`` (MooncakeStore, TCP).
        num_storage_units: SimpleStorage units (one Ray actor and 1 Ray CPU each).
        storage_capacity_rows: SimpleStorage ``total_storage_size``, a row count (not bytes).
        ray_address: Ray to join. ``None``: use this process's Ray if it has one, else
            ``$RAY_ADDRESS``, else start a local Ray (never a ``ray start`` cluster found on disk).
        ray_num_cpus: CPUs of a Ray we start; default controller + units + ``max(2, cores)``.
        ray_init_kwargs: extra ``ray.init`` arguments when we call it (our env vars are merged
            into any ``runtime_env`` given here).
        init_timeout_s: bound on start-up (``tq.init``) or attach.
        op_timeout_s: default bound of :meth:`TQDeployment.call`; also sizes TQ's own timeouts.
        mooncake_master_address: join this master instead of starting one (never stopped by us).
        mooncake_segment_bytes: memory the owner lends to the Mooncake pool (= capacity).
        mooncake_worker_segment_bytes: memory each attached process lends (0 = pure client).
        mooncake_local_buffer_bytes: Mooncake client ``local_buffer_size`` (TQ only uses ptr APIs).
        mooncake_hard_pin: hard-pin objects, so a full pool gives -200 instead of silent eviction.
        local_hostname: address Mooncake clients announce.
        tq_env: extra/overriding TQ environment variables (see :func:`tq_env`).
        tq_conf: dict merged last into the ``tq.init`` config (escape hatch).
        attach_only: never start anything: attach to the TransferQueue this Ray cluster runs, or
            raise (without starting Ray when this process has none and no address is given).
    """

    storage: Literal["simple", "mooncake"] = "simple"
    num_storage_units: int = 1
    storage_capacity_rows: int | None = None
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    ray_init_kwargs: Mapping[str, Any] = field(default_factory=dict)
    init_timeout_s: float = 60.0
    op_timeout_s: float = 30.0
    mooncake_master_address: str | None = None
    mooncake_segment_bytes: int = _GIB
    mooncake_worker_segment_bytes: int = 0
    mooncake_local_buffer_bytes: int = 64 << 20
    mooncake_hard_pin: bool = True
    local_hostname: str = "127.0.0.1"
    tq_env: Mapping[str, str] = field(default_factory=dict)
    tq_conf: Mapping[str, Any] = field(default_factory=dict)
    attach_only: bool = False

    def __post_init__(self) -> None:
        if self.storage not in ("simple", "mooncake"):
            raise ValueError(f"storage must be 'simple' or 'mooncake', got {self.storage!r}")
        if self.num_storage_units < 1:
            raise ValueError(f"num_storage_units must be >= 1, got {self.num_storage_units}")
        if self.storage_capacity_rows is not None and self.storage_capacity_rows < 1:
            raise ValueError(f"storage_capacity_rows must be >= 1 or None, got {self.storage_capacity_rows}")
        if self.storage_capacity_rows is not None and self.storage != "simple":
            raise ValueError(
                "storage_capacity_rows applies to storage='simple' only; size Mooncake with mooncake_segment_bytes"
            )
        for name in ("init_timeout_s", "op_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.mooncake_segment_bytes <= 0:
            raise ValueError("mooncake_segment_bytes must be > 0: the owner's segment is the pool")
        if self.mooncake_worker_segment_bytes < 0 or self.mooncake_local_buffer_bytes < 0:
            raise ValueError("mooncake_worker_segment_bytes and mooncake_local_buffer_bytes must be >= 0")

    @property
    def ray_cpus_needed(self) -> int:
        """Ray CPUs TQ's own actors take: the controller, plus one per SimpleStorage unit."""
        return 1 + units_in(build_conf(self, None))


def tq_env(cfg: TQDeployConfig) -> dict[str, str]:
    """TQ environment variables derived from ``cfg`` (all are read when ``transfer_queue`` is imported).

    A SimpleStorage request that gets no answer fails after at most
    ``MAX_ATTEMPTS * SEND_RECV_TIMEOUT + PROBE_TIMEOUT`` seconds, which we keep below
    ``op_timeout_s``, so TQ's own, more telling ``StorageUnitTimeout`` normally fires before our
    outer bound. Thread counts are capped at the core count (TQ warns on every call otherwise).
    """
    cores = os.cpu_count() or 1
    op = float(cfg.op_timeout_s)
    probe = max(1, min(5, int(op // 6)))
    attempts = 2
    send_recv = max(1, int((op - probe) // attempts))
    env = {
        "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": str(send_recv),
        "TQ_SIMPLE_STORAGE_MAX_ATTEMPTS": str(attempts),
        "TQ_SIMPLE_STORAGE_PROBE_TIMEOUT": str(probe),
        "TQ_DATA_UPDATE_RESPONSE_TIMEOUT": str(max(1, int(op // 2))),
        "TQ_STORAGE_HANDSHAKE_TIMEOUT": str(max(1, int(min(30.0, cfg.init_timeout_s)))),
        "TQ_NUM_THREADS": str(min(8, cores)),
        "TQ_CLIENT_ZMQ_IO_THREADS": str(min(8, cores)),
    }
    if cfg.storage == "mooncake":
        from dataplane._host.mooncake_master import client_env_defaults

        env.update(client_env_defaults())
    env.update({str(k): str(v) for k, v in cfg.tq_env.items()})
    return env


def apply_env(env: Mapping[str, str]) -> None:
    """Put ``env`` into ``os.environ`` (values the user already set win) and into loaded TQ modules."""
    for key, value in env.items():
        if key in os.environ and os.environ[key] != value:
            logger.info("keeping %s=%s from the environment (dataplane would set %s)", key, os.environ[key], value)
        os.environ.setdefault(key, value)
    # TQ copies these into module constants at import; if it is already imported (by the user or by
    # an earlier task in this reused Ray worker), the environment alone no longer reaches it.
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "transfer_queue" or name.startswith("transfer_queue.")):
            continue
        for key in env:
            current = getattr(module, key, None)
            if isinstance(current, (int, float)) and not isinstance(current, bool):
                wanted = type(current)(float(os.environ[key]))
                if wanted != current:
                    setattr(module, key, wanted)


def build_conf(cfg: TQDeployConfig, master_address: str | None) -> dict[str, Any]:
    if cfg.storage == "simple":
        backend: dict[str, Any] = {
            "storage_backend": "SimpleStorage",
            "SimpleStorage": {
                "num_data_storage_units": cfg.num_storage_units,
                "total_storage_size": cfg.storage_capacity_rows,
            },
        }
    else:
        backend = {
            "storage_backend": "MooncakeStore",
            "MooncakeStore": {
                "auto_init": False,  # True pkills every mooncake_master on the host
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master_address,
                "local_hostname": cfg.local_hostname,
                "protocol": "tcp",
                "global_segment_size": int(cfg.mooncake_segment_bytes),
                "local_buffer_size": int(cfg.mooncake_local_buffer_bytes),
                "device_name": "",
                "hard_pin": bool(cfg.mooncake_hard_pin),
            },
        }
    # polling: a fetch of more rows than are ready answers at once with none, where TQ's default
    # sleeps 5 s inside the controller's one request thread, stalling every client (claim_meta)
    conf: dict[str, Any] = {"backend": backend, "controller": {"polling_mode": True}}
    return _deep_merge(conf, dict(cfg.tq_conf))


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def units_in(conf: Mapping[str, Any]) -> int:
    backend = conf["backend"]
    if backend["storage_backend"] != "SimpleStorage":
        return 0
    return int(backend["SimpleStorage"]["num_data_storage_units"])
