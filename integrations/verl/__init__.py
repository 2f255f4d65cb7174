"""verl on dataplane: a ``transfer_queue``-compatible facade, so verl's TransferQueue trainer runs on
``mooncake://`` (or ``tq://``) through dataplane.

    import integrations.verl
    integrations.verl.install("mooncake://local")   # in the driver, before verl and Ray start
    # ... then run verl as usual: every `import transfer_queue` in the job gets the facade

See ``docs/verl.md`` for what changes for a verl user (dropped keys and fields vs strict mode, tags,
one schema per field, results that share memory with the store).
"""

from integrations.verl.facade import MissingRows
from integrations.verl.installer import env_vars, install, installed_url, uninstall
from integrations.verl.metas import BatchMeta, KVBatchMeta

__all__ = ["BatchMeta", "KVBatchMeta", "MissingRows", "env_vars", "install", "installed_url", "uninstall"]
