"""The planner's size limits: above them it refuses with a clear error instead of running out of time or memory.

Within them every solve's memory is bounded (arrays grow at most with the global batch, option
tables with the memory-feasible micro-batch sizes) and a plan takes seconds at worst
(``tests/planner/test_planner_scale.py`` checks both ends; ``benchmarks/bench_planner.py`` prints the
scaling).
"""

MAX_GLOBAL_BATCH = 2**18  # samples per optimizer step (262,144)
MAX_RANKS = 100_000  # the plan file has one entry per rank
# a cluster file may list more ranks than one plan holds (the planner then says how to plan a
# sub-cluster), but not so many that listing them, one entry each, would fill the memory first
MAX_CLUSTER_RANKS = 10 * MAX_RANKS
