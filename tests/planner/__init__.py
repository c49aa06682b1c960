"""The planner's tests (torch-free): schema, cost model, search, plans."""
