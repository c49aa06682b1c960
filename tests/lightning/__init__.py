"""The Lightning layer's tests: the strategy, its options, Fabric, the CLI, precision."""
