"""The pluggy markers for project "spmd"; import them as ``spmd.hookspec``/``spmd.hookimpl``."""

import pluggy

PROJECT = "spmd"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
