"""The flight recorder, its dumps, the signatures of calls, and the offline analysis of dumps.

The live checks that use them (the watchdog, desync and first-call checks, the
always-on mismatch checks) are ``spmd.comm.health``: this package sits below
the communication layer and imports nothing of it.

Environment switches (also ``spmd.init`` options where noted):

``SPMD_TRACE_DIR``          where dumps go (one ``rank<N>.json`` per rank); default ``./spmd_traces``
``SPMD_FLIGHT_RECORDER=N``  ring-buffer entries per process (default 2000; 0 turns recording off)
``SPMD_WATCHDOG=0``         no watchdog thread (no progress publishing, no dumps on request)
``SPMD_WATCHDOG_INTERVAL``  seconds between progress publications (default 1.0)
``SPMD_DESYNC_CHECK=1``     compare op, shapes, dtypes and reduce op across ranks before each collective
``SPMD_HISTORY_CHECK=0``    no always-on mismatch check (the watchdog's comparison of recent calls, ``spmd.comm.health.history``)
"""

from spmd.debug.dump import dump, dump_format_version
from spmd.debug.recorder import Entry, FlightRecorder, recorder

__all__ = ["Entry", "FlightRecorder", "dump", "dump_format_version", "recorder"]
