"""The names of a checkpoint's files and keys, its format version, and the error every refusal raises."""

from __future__ import annotations

from cephalo_lightning._common.errors import CephaloError

FORMAT = 2
META_FILE = "meta.pt"
INFO_FILE = "cephalo.json"
MANIFEST_FILE = "manifest.json"
MODEL_PREFIX = "model."


class CheckpointError(CephaloError, RuntimeError):
    """A checkpoint cannot be written or read: what is wrong, which file, what to do."""
