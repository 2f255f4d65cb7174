"""Runnable examples: ``python -m integrations.rl.examples.<name>``."""
