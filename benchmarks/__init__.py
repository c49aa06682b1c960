"""The benchmarks, run from the repository root: ``python -m benchmarks.bench_<name>`` (``harness.py``,
``registry.py``); ``python -m benchmarks`` runs several."""
