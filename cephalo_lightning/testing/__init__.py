"""Helpers that tests, benchmarks and examples share: launching local gloo ranks."""
