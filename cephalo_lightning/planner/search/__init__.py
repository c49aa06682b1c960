"""The search: the assignment (knapsack over per-kind option tables, water-filled shares), the
shard groupings, the published peers and baselines, and the checks before a solve."""
