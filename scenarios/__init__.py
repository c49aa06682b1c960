"""The worker scripts and helpers that tests and benchmarks both start: the fault-tolerance lives
(:mod:`scenarios.ft_worker`), the elastic torchrun rank and its agents (:mod:`scenarios.elastic_worker`,
:mod:`scenarios.torchrun_agents`), the checkpoint kill points (:mod:`scenarios.kill_points`) and the
per-unit optimizers (:mod:`scenarios.unit_optimizers`).

Not a test module (pytest collects nothing here) and not shipped (the wheel holds ``cephalo_lightning``
only): benchmarks import from here, never from ``tests``' test files.
"""
