"""Test kit shipped with dataplane: the adapter conformance suite, strategies and a state machine.

Importing this package needs pytest and hypothesis (``pip install 'dataplane[dev]'``).
"""

from dataplane.testing.conformance import ClientConformance
from dataplane.testing.logs import noisy_lines
from dataplane.testing.stateful import make_state_machine

__all__ = ["ClientConformance", "make_state_machine", "noisy_lines"]
