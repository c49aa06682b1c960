"""A CPU process standing in for a slower or smaller GPU: the emulator, the memory accounting and the
emulated links between nodes."""

from cephalo_lightning.runtime.emulation.emulator import (
    DeviceEmulator,
    EmulationSpec,
    EmulationSpecError,
    emulator_for_rank,
    parse_emulation,
    parse_emulation_specs,
)
from cephalo_lightning.runtime.emulation.links import EmulatedLinks, links_from_emulation
from cephalo_lightning.runtime.emulation.memory import EmulatedOutOfMemoryError, MemoryTracker

__all__ = ["DeviceEmulator", "EmulatedLinks", "EmulatedOutOfMemoryError", "EmulationSpec", "EmulationSpecError",
           "MemoryTracker", "emulator_for_rank", "links_from_emulation", "parse_emulation", "parse_emulation_specs"]
