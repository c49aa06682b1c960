"""What the planner reads and writes: the cluster's description (model, devices, links,
settings, the catalog, calibration terms, size limits) and the plan file, with their one error."""
