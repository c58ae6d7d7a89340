"""Communication: the backend contract, Work, ReduceOp, groups and the collectives API."""
