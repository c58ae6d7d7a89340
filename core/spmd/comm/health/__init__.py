"""The live health of a job's groups: the watchdog thread, announcements that a rank gave a group up,
the desync and first-call checks, the always-on mismatch checks of collectives and point-to-point calls.

It sits in the communication layer it watches (above the pure flight recorder of ``spmd.debug``) and is
handed what it watches (the groups, the store) by ``spmd.comm.init``; it imports nothing of comm's above it.
"""
