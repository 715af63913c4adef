"""Benchmarks, not tests: ``python tests/bench/run.py`` prints docs/performance.md's tables."""
