"""Benchmarks of the pin-nightly jobs (not part of the test suite): ``python -m bench.run``."""
