"""Rank 0 raises a Python error: the agent's summary must show its traceback."""

import os

if os.environ["RANK"] == "0":
    raise ValueError("bad learning rate 42")
