"""Weight-sync benchmark: `python -m benchmarks.sync --help`."""
