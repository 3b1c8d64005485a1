"""Benchmarks: A/B against host engines, runtime overhead and memory checks (see each module)."""
