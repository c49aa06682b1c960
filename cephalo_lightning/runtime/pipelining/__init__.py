"""Pipelined plans in the runtime: stages of layers, point-to-point transfers, GPipe and 1F1B."""
