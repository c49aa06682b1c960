"""A CPU process standing in for a slower or smaller GPU: the emulator and the memory accounting."""

from cephalo_lightning.runtime.emulation.emulator import (
    DeviceEmulator,
    EmulationSpec,
    EmulationSpecError,
    emulator_for_rank,
    parse_emulation,
    parse_emulation_specs,
)
from cephalo_lightning.runtime.emulation.memory import EmulatedOutOfMemoryError, MemoryTracker

__all__ = ["DeviceEmulator", "EmulatedOutOfMemoryError", "EmulationSpec", "EmulationSpecError", "MemoryTracker",
           "emulator_for_rank", "parse_emulation", "parse_emulation_specs"]
