"""``tq://``: TransferQueue (Ray-based) with its ``simple`` or ``mooncake`` storage backend.

One TransferQueue runs per Ray cluster. The first process to connect with a ``backend`` starts it
(Ray too, if the process has none) and owns it; every other process -- a Ray actor typically just
calls ``dataplane.connect("tq://")``, a plain process the owner's ``client.url``
(``tq://?ray_address=GCS``, also exported as ``$DATAPLANE_URL``) -- attaches. Only the owner's last client tears the deployment
down (its actors, its ``mooncake_master``, and Ray if it started Ray); anyone else's ``close()``
closes only that client. TQ's client is process-global, so all clients of one process share one
attachment, refcounted.

What the adapter adds on top of TQ (each gap measured on ``transferqueue`` 0.1.11): a
per-(partition, field) schema kept in the partition itself and checked before anything is written;
exact shapes, dtypes and kinds on the way back; object columns as msgpack bytes (TQ never pickles);
no phantom keys after a failed put; gets that raise ``KeyNotFound`` naming what is missing where TQ
silently drops it; a timeout on every call; TQ's capacity errors and Mooncake's ``-200`` as
``CapacityExceeded``. Layout and round trips: :mod:`._layout`, :mod:`._ops`; configuration and deployment:
:mod:`._deploy_config`, :mod:`._deployment`.

On a failed put (a storage error, a timeout) the keys the put created are removed again. Keys that
existed before keep their tags and their other fields, but each field the put was writing may hold
its old or its new value on each of them (TQ has no transactions): re-write or clear them.

User guide (options, deployment, limits): ``docs/backends/transfer_queue.md``; the layout inside
TransferQueue: ``docs/design/transfer-queue-layout.md``.

>>> import dataplane  # doctest: +SKIP
>>> with dataplane.connect("tq://?backend=simple") as client:  # doctest: +SKIP
...     meta = client.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 3)}, partition_id="train")
"""

from dataplane.adapters.transfer_queue._store import TQConfig, TQStore, attached_clients, connect

__all__ = ["TQConfig", "TQStore", "attached_clients", "connect"]
