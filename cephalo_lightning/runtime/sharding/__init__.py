"""Uneven ZeRO-3 sharding: the layout, flat units, unit grouping, materialisation, the sharded model."""
