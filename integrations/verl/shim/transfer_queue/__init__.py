"""``transfer_queue`` as dataplane's verl facade (:mod:`integrations.verl.facade`).

Importable under this name only where :func:`integrations.verl.install` put its parent directory on
the path. Submodules (``transfer_queue.interface``, ``transfer_queue.controller``, ...) still load
from the real TransferQueue package when it is installed, so that dataplane's own ``tq://`` adapter
and TransferQueue's actors keep working beside the facade.
"""

from integrations.verl.facade import *  # noqa: F403
from integrations.verl.facade import __all__ as __all__
from integrations.verl.installer import real_transfer_queue_path

__path__ = real_transfer_queue_path()  # submodules come from the real package
FACADE = True
