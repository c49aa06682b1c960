"""The profiler's tests."""
