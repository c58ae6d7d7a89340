"""Launching: cluster environments (and, later, the ``spmd run`` agent)."""
