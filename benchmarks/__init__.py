"""lakefs-mount benchmark suite: `python -m benchmarks run [--quick]` (see README.md)."""
