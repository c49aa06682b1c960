"""``CephaloCallback`` and what it runs: profiling at setup, the run model, calibration, drift and
straggler adaptation, and plain progress lines."""
