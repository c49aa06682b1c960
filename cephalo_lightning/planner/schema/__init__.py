"""The planner's data and its files: the cluster's description (model, devices, links, settings,
the GPU catalog, calibration terms, size limits), the plan, their field checks, and the one error."""
