"""Integrations of dataplane with RL frameworks. Depends on ``dataplane``; ``dataplane`` never imports it."""
