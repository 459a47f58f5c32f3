"""Benchmarks: each prints a table and writes JSON (and PNG plots where a curve says more)."""
