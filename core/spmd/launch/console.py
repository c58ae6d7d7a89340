"""Whether a worker's output reaches a terminal, through ``spmd run``'s pipes too.

``spmd run`` forwards each worker's output through a pipe (to prefix its lines
and keep a tail for the failure summary), so ``sys.stderr.isatty()`` is False
in every worker even when the user watches a terminal. The agent says so in
``SPMD_CONSOLE_IS_TERMINAL``; a script asks ``console_is_terminal()`` to decide
whether to draw a progress bar, as it would under torchrun.
"""

from __future__ import annotations

import sys
from typing import TextIO

from spmd import settings

#: Set to "1" by ``spmd run`` for its workers when its own console (stderr) is a terminal.
CONSOLE_VARIABLE = "SPMD_CONSOLE_IS_TERMINAL"


def console_is_terminal(stream: TextIO | None = None) -> bool:
    """True if ``stream`` (default: stderr) is a terminal, or ``spmd run`` forwards it to one."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # a closed or replaced stream
        pass
    return settings.current().console_is_terminal


def agent_console_is_terminal() -> bool:
    """What the agent passes on: whether its own stderr, where workers' output ends up, is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
