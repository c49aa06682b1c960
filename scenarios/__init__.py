"""The worker scripts and helpers that tests and benchmarks both start: the fault-tolerance lives
(:mod:`scenarios.ft_worker`), the elastic torchrun rank and its agents (:mod:`scenarios.elastic_worker`,
:mod:`scenarios.torchrun_agents`), the run with failures (:mod:`scenarios.failure_run`), the checkpoint
kill points (:mod:`scenarios.kill_points`), the per-unit optimizers (:mod:`scenarios.unit_optimizers`) and
the ending of a started process with all it started (:mod:`scenarios.process_tree`).

Not a test module (pytest collects nothing here) and not shipped (the wheel holds ``cephalo_lightning``
only): benchmarks import from here, never from ``tests``' test files.
"""
