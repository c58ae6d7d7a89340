"""Ways to run spmd jobs on other engines; each needs its engine's extra (``spmd.integrations.ray``: ``spmd[ray]``)."""
