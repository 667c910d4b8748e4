"""Training operations: wall-clock budget, checkpoint receipts and pruning, resume, non-finite guard,
one-run lock, submission patch."""
