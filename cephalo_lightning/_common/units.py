"""Units of measure every layer shares (torch-free, so the planner can import them)."""

GIB = float(2**30)  # bytes in a GiB, the unit torch.cuda reports and every memory figure here uses
