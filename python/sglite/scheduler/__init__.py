"""The scheduler: requests, admission, batches, the loops, result processing."""
