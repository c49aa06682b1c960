"""The callback's tests: profiling, the run model, adaptation, reporting."""
