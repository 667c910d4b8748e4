"""Training operations: wall-clock budget, checkpoint receipts, validation and pruning, resume, the
non-finite guard, the run summary, the one-run lock, the save's background writer and finish."""
