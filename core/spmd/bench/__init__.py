"""``spmd bench``: nccl-tests-style measurements of every backend, side by side.

``timing`` holds the shared measuring machinery (call-by-call alternation,
medians, the bandwidth formulas); ``ops`` the spmd side of each op;
``worker`` what each rank runs; ``runner`` launches ranks per backend;
``report`` prints tables, CSV, JSON and plots; ``launch`` starts N local
ranks (env rendezvous), for ``runner`` and the scripts in ``benchmarks/``.
"""

from spmd.bench.timing import PeerContext, bus_factor, size_sweep, time_interleaved

__all__ = ["PeerContext", "bus_factor", "size_sweep", "time_interleaved"]
