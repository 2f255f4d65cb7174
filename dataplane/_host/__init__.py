"""Private kit the adapters share: host memory and threads, row tables, child processes.

Nothing here is public API; adapters import these modules, never each other's.

* :mod:`.threads`: helper threads started on first use (and again after a fork).
* :mod:`.hostcopy`: host byte copies that leave no busy threads behind.
* :mod:`.bufpool`: a pool of already-faulted host buffers handed out as tensors.
* :mod:`.slots`: a partition's rows as slots and per-field arrays (memory and Mooncake stores).
* :mod:`.processes`: orphan-safe child processes, stopped by PID and at exit.
* :mod:`.mooncake_master`: a ``mooncake_master`` on free ports, and the Mooncake client
  environment (the Mooncake adapter and TransferQueue's Mooncake backend both use it).
"""
