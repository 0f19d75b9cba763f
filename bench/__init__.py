"""Benchmarks: measure the project against peers in one run on one machine (not tests)."""
