"""Benchmarks of verl-klcov-global (not part of the test suite): ``python -m benchmarks.run --help``."""
