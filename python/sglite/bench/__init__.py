"""Serving benchmark pieces: workloads and records, statistics and the report."""
