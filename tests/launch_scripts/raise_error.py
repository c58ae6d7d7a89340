"""Rank 0 raises a Python error: its traceback reaches the terminal once and the agent points at it."""

import os

if os.environ["RANK"] == "0":
    raise ValueError("bad learning rate 42")
