"""``mooncake://``: Mooncake Store directly, zero-copy, no Ray needed.

``mooncake://local`` starts and owns a ``mooncake_master`` and one store-server process (which lends
``segment_bytes`` of RAM to the pool) on free loopback ports, waits until both are healthy, and stops
both on ``close()``; they also stop if the owning process dies (``PR_SET_PDEATHSIG``, plus a stdin
watchdog for the TCP server). ``mooncake://HOST:PORT`` joins a running master (``HOST:PORT`` is its
RPC address); other processes of the job join the owner's deployment with ``client.store.join_url``.

Transport. By default (``shm=true``) the store server of ``mooncake://local`` is a Mooncake "real
client" (``mooncake_client``, shipped in the wheel) and every client of the deployment attaches to
it (``setup_dummy``): the real client copies between its segment and the caller's shared memory,
several times faster than loopback TCP. Mooncake cannot read other memory
of the caller, so a put sends tensors that lie in that shared memory as they are (tensors from
``client.empty()``, or from a get: a write-back) and copies any other tensor into it first; gets
land in it and are returned as they are. Such memory stays mapped until the process exits (Mooncake
never unmaps it), so it is kept in 256 MiB regions and reused, by later clients of the process too
(:mod:`._shm`).
``shm=false`` starts a plain store server instead, reached over loopback TCP. Mooncake logs two
harmless error lines around attaching and closing (``Failed to receive hot cache fd``, ``Dummy
Client not connected``); ``MC_LOG_LEVEL`` (default ``WARNING``) does not silence glog errors.

Clients lend no memory by default (``client_segment_bytes=0``): in Mooncake an object dies with the
process whose segment holds it, so data lives in dedicated store servers and outlives the writers.

Layout (see :mod:`._index`): per put call, one data object per field holding every row back to
back, plus one small immutable index object, written in one batch call. Every Mooncake object costs
a fixed ~30-40 us, so one object per (row, field) makes puts and whole-batch gets several times
slower; it wins only where a data-parallel rank reads a sparse subset of a large batch (``python -m
benchmarks.mooncake_layout`` compares them on raw Mooncake). One object per put holding every field
would make every get of some of the fields a ranged read (~40 us per range), so only small puts are
packed that way: a put of at most 1 MiB with two or more non-empty fields (a rollout put on its own,
say) is one data object, its fields at 64-byte aligned offsets its index names, and a get reads each
packed put it needs once, whole. The index object costs nothing measurable.

Round trips. A put: one listing of the master's keys (``/get_all_keys`` on its admin port, ~0.1 ms:
the schema check against every writer) plus one batch write. A client's later puts of the same
fields (same dtypes) into that partition skip the listing: they ask the master only whether the
client's own latest put of each field is still there (``/batch_query_keys``, a few keys). A put
still there passed the check when it was written, and a clear that emptied the field since would
have removed it; anything else (a new field, another dtype, the put gone) lists. A get: one
listing, one batch read that lands directly in pooled, registered buffers which become the returned
tensors (the rows of one put, in order), or that reads whole objects / merged row ranges (whichever
the cost model says is cheaper) and gathers locally, then one query (or a listing, where the rows
came from so many puts that it costs less): the bytes read are kept only while the index object of
every put they came from is still there after the read. (A clear
removes objects a read may be in the middle of, and Mooncake may hand the space to another put at
once, so a read can return another object's bytes with no error; clears remove index objects
before the data they name, so an index still there after the read vouches for its data.) Index
objects are immutable and cached (one read of a put not seen before, trusted the same way); a put
returns its index in ``meta.extra_info["mooncake_index"]``, so a get by that meta in another
process needs no index read either (the hint is used only while the listing still shows it: a
stale hint never returns stale data), and a read hint in ``meta.extra_info["mooncake_read"]`` (the
put's objects and sizes), so such a get issues its read first, then its one listing (which both
vouches for the read and shows whether other puts came since), and decodes the index meanwhile (on
a helper thread beside the read where the host has the cores, ``DATAPLANE_DECODE_THREAD``).
Where the master lacks ``/batch_query_keys``, the queries fall back to listings.
Listing costs grow with the number of keys in the master, anyone's (~1 us per key: 10,000 keys add
~3-9 ms to every get and to a client's first put into a partition, ``python -m
benchmarks.mooncake_scale``), so give dataplane a master of its own rather than one shared with,
say, an inference engine's KV cache.

Rules this adapter relies on:

* One writer per (key, field) at a time. Writers in different processes may share a partition
  (distinct keys); two concurrent writers of one key race, and the later ``put_id`` (wall time) wins.
* Keys are ASCII, at most 512 characters. Objects are hard-pinned: a full store raises
  ``CapacityExceeded`` instead of evicting unread rollouts. ``kv_clear(keys)`` writes a tombstone and
  removes the puts nothing reads any more; rows only re-written (never cleared) keep their old
  objects until a clear touches the partition. ``kv_clear(partition_id=...)`` removes the puts its
  listing shows (a put racing it stays whole) and data left by writers that died mid-put over 10
  minutes before. Removal is forced (every read takes a 10 s lease that would block it), which is
  why reads check after reading that what they read is still there.
* Never ``fork()`` a process holding a client: the child gets ``BackendUnavailable``. Use ``spawn``.
* ``timeout_s`` bounds our retries and the listing; a Mooncake transfer itself cannot be interrupted
  (its engine gives up after 60 s). After a store server dies its rows read as ``BackendUnavailable``
  (transfer failures, retried briefly) and, once the master expires it (``client_ttl_s``), as
  ``KeyNotFound``. Capacity is the store servers' segments: there is no per-client row or byte cap.

Running on a cluster (one master, one store server per node that lends memory)::

    # head node
    mooncake_master --rpc_address=0.0.0.0 --rpc_port=50051 --metrics_port=9003 --client_ttl=10
    # every node that lends memory (routable address of this node; 64 GiB here): a real client, so
    # the processes of that node reach it through shared memory; its copies of 256 KiB and more
    # streamed past the caches, as mooncake://local starts it (_servers.STREAMING_COPY_TUNABLE)
    GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x40000 \\
    mooncake_client --master_server_address=HEAD:50051 --metadata_server=P2PHANDSHAKE --host=$NODE_IP \\
        --port=50052 --global_segment_size=68719476736 --protocol=rdma --device_names=mlx5_0,mlx5_1
    # every process of the job, on a node running a real client
    client = dataplane.connect("mooncake://HEAD:50051?metrics_port=9003&real_client=127.0.0.1:50052")
    # or, on a node without one: a network client of the store servers
    client = dataplane.connect("mooncake://HEAD:50051?metrics_port=9003&protocol=rdma&rdma_devices=mlx5_0")

A plain store server (no shared memory) is
``python -m dataplane.adapters.mooncake.store_server --master HEAD:50051 --host $NODE_IP --segment-bytes N
--protocol rdma --rdma-devices mlx5_0 --no-stdin-watchdog``.

``protocol`` is ``tcp`` (default) or ``rdma``; ``rdma_devices`` is a comma list of HCA names
(``ibv_devices`` lists them); Mooncake silently falls back to TCP when it finds no RDMA device, so
check its log. Each process announces ``local_hostname`` to its peers; by default the address of
the interface that routes to the master (never a link-local one: peers cannot reach it). With RDMA,
a put copies tensors that are not in this client's registered pool (``client.empty()`` hands out
pooled memory) into it first; reads always land in registered buffers.

>>> import dataplane, torch  # doctest: +SKIP
>>> with dataplane.connect("mooncake://local?segment_bytes=256MiB") as c:  # doctest: +SKIP
...     meta = c.kv_batch_put(["a", "b"], {"x": torch.arange(2)}, partition_id="train")
...     c.kv_batch_get(meta, select_fields="x")["x"].tolist()
[0, 1]
"""

from dataplane._host.mooncake_master import apply_client_env_defaults, start_master
from dataplane.adapters.mooncake._connect import LocalDeployment, MooncakeConfig, connect, parse_bytes
from dataplane.adapters.mooncake._handle import MAX_KEYS_PER_CALL, AdminClient
from dataplane.adapters.mooncake._store import HINT_KEY, MooncakeStore

__all__ = [
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
