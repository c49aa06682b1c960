"""The Lightning layer: the strategy, one fit's runtime, the training steps, the callback, the CLI.

Everything here may import Lightning; nothing below it (planner, runtime, profiling, models) does.
"""
