"""Torch-free helpers shared by every layer, the planner included."""
