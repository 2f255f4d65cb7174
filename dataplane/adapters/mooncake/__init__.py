"""``mooncake://``: Mooncake Store directly, zero-copy, no Ray needed.

``mooncake://local`` starts and owns a ``mooncake_master`` and one store server on free loopback
ports and stops both on ``close()`` (or when the owning process dies); ``mooncake://HOST:PORT`` joins
a running master. Other processes of the job join the owner's deployment with ``client.url`` (the
owner exports it as ``$DATAPLANE_URL`` to the processes it starts afterwards, where
``dataplane.connect()`` joins it). By default (``shm=true``) every process moves data to and from the store
server through shared memory; ``shm=false`` goes over loopback TCP. Clients lend no memory (an
object dies with the process that lent it), objects are hard-pinned (a full store raises
``CapacityExceeded``), and a get keeps what it read only if every put it read from is still there
after the read, since a concurrent clear may free an object mid-read.

User guide (options, cluster recipe, RDMA, limits): ``docs/backends/mooncake.md``. How it works:
``docs/design/object-layout.md`` (objects per put, packed puts, reads),
``docs/design/get-protocol.md`` (round trips, and why a read is checked after it) and
``docs/design/decode-overlap.md`` (decoding beside the transfer). A plain store server for a
cluster node is ``python -m dataplane.adapters.mooncake.store_server --help``.

Modules: ``_connect`` (options, deployment, ``connect``), ``_store`` (the :class:`MooncakeStore`,
made of ``_partitions``, ``_put``, ``_get``, ``_clear`` and ``_claims``: claim markers, ``docs/claims.md``), ``_index`` (object names and index
objects), ``_read`` (planning a get's reads), ``_handle`` (the guarded Mooncake client and the
master's admin API), ``_shm`` (shared-memory arenas), ``_servers`` and ``store_server`` (store
server processes).

>>> import dataplane, torch  # doctest: +SKIP
>>> with dataplane.connect("mooncake://local?segment_bytes=256MiB") as c:  # doctest: +SKIP
...     meta = c.kv_batch_put(["a", "b"], {"x": torch.arange(2)}, partition_id="train")
...     c.kv_batch_get(meta, select_fields="x")["x"].tolist()
[0, 1]
"""

from dataplane._host.mooncake_master import apply_client_env_defaults, start_master
from dataplane.adapters.mooncake._connect import DEPLOYMENT_KEY, LocalDeployment, MooncakeConfig, connect, parse_bytes
from dataplane.adapters.mooncake._handle import MAX_KEYS_PER_CALL, AdminClient
from dataplane.adapters.mooncake._store import HINT_KEY, MooncakeStore

__all__ = [
    "DEPLOYMENT_KEY",
    "HINT_KEY",
    "MAX_KEYS_PER_CALL",
    "AdminClient",
    "LocalDeployment",
    "MooncakeConfig",
    "MooncakeStore",
    "apply_client_env_defaults",
    "connect",
    "parse_bytes",
    "start_master",
]
