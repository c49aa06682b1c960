"""The runtime's tests: sharding, collectives, the layered schedule, checkpoints, emulation."""
