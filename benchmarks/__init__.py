"""Measured comparisons; each sub-package runs as `python -m benchmarks.<name>` and writes JSON."""
