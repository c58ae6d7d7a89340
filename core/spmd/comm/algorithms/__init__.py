"""Generic collective algorithms built only on a backend's isend/irecv.

Each function blocks until its part is done and is run by the Backend base
class on the backend's worker thread. Tensors are flat and contiguous (the
kernel guarantees it); ranks are group-local. Every algorithm is correct for
any world size from 1, not only powers of two.
"""

from spmd.comm.algorithms.doubling import all_reduce_recursive_doubling, barrier_dissemination
from spmd.comm.algorithms.pairwise import all_to_all_pairwise, gather_linear, scatter_linear
from spmd.comm.algorithms.ring import all_gather_ring, all_reduce_ring, reduce_scatter_ring
from spmd.comm.algorithms.tree import broadcast_binomial, reduce_binomial

__all__ = [
    "all_gather_ring",
    "all_reduce_recursive_doubling",
    "all_reduce_ring",
    "all_to_all_pairwise",
    "barrier_dissemination",
    "broadcast_binomial",
    "gather_linear",
    "reduce_binomial",
    "reduce_scatter_ring",
    "scatter_linear",
]
