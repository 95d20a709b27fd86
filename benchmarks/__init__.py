"""Timing scripts, run from the repository root as ``python -m benchmarks.<script>``.

Shared timing, JSON and table helpers live in :mod:`benchmarks.common`."""
