"""The error profiling raises on every rank when any rank's measurement failed."""

from cephalo_lightning._common.errors import CephaloError


class ProfilingError(CephaloError, RuntimeError):
    """Profiling failed on some rank; raised on every rank, naming the one that failed."""
