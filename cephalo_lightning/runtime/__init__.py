"""The torch runtime (no Lightning): sharding, collectives, the layered schedule, checkpoints, emulation.

``sharding/`` holds the uneven ZeRO-3 state (layout, flat units, the sharded model),
``checkpoint/`` the DCP format with its manifest, ``emulation/`` the CPU stand-in for a slower or
smaller GPU; :mod:`.distributed` is the one home of the process-group helpers.
"""
