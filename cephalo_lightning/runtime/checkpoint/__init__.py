"""Sharded checkpoints keyed by logical tensor: save at one layout, load at any other.

Every parameter is saved under its ORIGINAL name and shape through torch.distributed.checkpoint
(DCP), with public planners (:class:`ShardSavePlanner`, :class:`ShardLoadPlanner`): each rank
writes only the piece it owns, described as the few rectangular chunks a contiguous range of a
row-major tensor decomposes into (:func:`boxes`). Optimizer moments are saved the same way. On
load, every rank reads the overlap of the stored chunks with the pieces the *current* layout asks
for, so a checkpoint written at shares [0.6, 0.3, 0.1] on 3 ranks loads at [0.25, 0.75] on 2, at
even shares on 4, or without any process group; DCP's own tools (``dcp_to_torch_save``) and
Lightning's ``consolidate_checkpoint`` read it as an ordinary sharded checkpoint.

A checkpoint is a directory::

    .metadata, __<rank>_<i>.distcp   DCP: tensors under "model.<name>", "optimizer_<i>.state.<name>.<key>"
    meta.pt                          Lightning's other state (loops, callbacks, ...): weights-only data,
                                     and the save's token
    cephalo.json                     the plan, parameter shapes, optimizer groups by name, format version,
                                     the save's token and the DCP files' sizes and SHA-256
    manifest.json                    every file's size and SHA-256 and the save's token, written LAST

[Note: nothing loaded executes code] ``meta.pt`` is read with ``torch.load(weights_only=True)``
and an explicit allow-list (:data:`SAFE_GLOBALS`); DCP's pickled ``.metadata`` is read by
:class:`SafeFileSystemReader`, whose unpickler admits only DCP's metadata classes; tensors are
read by DCP with ``weights_only=True``; everything else is JSON.

[Note: a checkpoint that loads is complete] It is written in a staging directory and published
atomically (:func:`~cephalo_lightning._common.atomic_io.publish_directory`); the manifest is written last
and verified before anything is read (sizes, and checksums shared out between the ranks), so a
truncated, corrupted or half-deleted checkpoint is refused with the name of the file. Every file a
load reads must be in the manifest, and the files must be those of one save (the token and the
checksums ``cephalo.json`` recorded): files of two checkpoints under one regenerated manifest are
refused too. A save that fails (a full disk: :class:`NoSpaceError`, ``errno`` ENOSPC) removes what
it wrote; the checkpoint already at its path is untouched.

[Note: a single file vouches for itself] A single-file checkpoint (``state_dict_type="full"``,
:func:`consolidate`) carries the SHA-256 of its content under :data:`INTEGRITY_KEY` and stays an
ordinary Lightning file; cephalo's loads check it, :func:`verify_file` checks it for loaders that
cannot (``LightningModule.load_from_checkpoint``, ``torch.load``).

The modules, one concern each: :mod:`.format` (file names, version, :class:`CheckpointError`),
:mod:`.dcp_planners` (chunks and DCP's planners), :mod:`.entries` (what of a sharded model is
stored under which key), :mod:`.safe_load` (unpickling without running code), :mod:`.manifest`
(sizes, checksums, completeness, one save), :mod:`.save_load` (the collective save and load, over
the model's process group), :mod:`.consolidate` (whole tensors and single-file checkpoints,
offline), :mod:`.single_file` (a single file's own checksum), :mod:`.frozen_base` (what identifies
the frozen base of a checkpoint that holds the trainable parameters alone).
"""

from cephalo_lightning.runtime.checkpoint.consolidate import (
    consolidate,
    consolidated,
    consolidated_dict,
    full_tensors,
    load_full_state_dict,
)
from cephalo_lightning.runtime.checkpoint.dcp_planners import Box, ShardLoadPlanner, ShardSavePlanner, boxes
from cephalo_lightning.runtime.checkpoint.entries import (
    SavedOptimizer,
    buffers,
    model_entries,
    optimizer_entries,
    state_dict_aliases,
)
from cephalo_lightning.runtime.checkpoint.format import (
    FORMAT,
    INFO_FILE,
    MANIFEST_FILE,
    META_FILE,
    MODEL_PREFIX,
    CheckpointError,
    NoSpaceError,
)
from cephalo_lightning.runtime.checkpoint.frozen_base import FrozenBase, identify_frozen
from cephalo_lightning.runtime.checkpoint.manifest import (
    _sha256,  # noqa: F401 - the tests forge manifests with it
    is_checkpoint,
    is_complete,
    read_manifest,
    verify,
)
from cephalo_lightning.runtime.checkpoint.portable import restore_sampler_states, set_aside_sampler_states
from cephalo_lightning.runtime.checkpoint.safe_load import (
    SAFE_GLOBALS,
    SafeFileSystemReader,
    check_loadable,
    read_dcp_metadata,
    safe_load,
)
from cephalo_lightning.runtime.checkpoint.save_load import (
    clean_stale,
    load,
    on_first_rank,
    read_info,
    read_meta,
    remove,
    save,
    single_file_staging,
)
from cephalo_lightning.runtime.checkpoint.single_file import (
    INTEGRITY_KEY,
    content_sha256,
    load_file,
    verify_file,
    write_file,
)

__all__ = [
    "Box", "CheckpointError", "FORMAT", "FrozenBase", "INFO_FILE", "INTEGRITY_KEY", "MANIFEST_FILE", "META_FILE",
    "MODEL_PREFIX", "NoSpaceError", "SAFE_GLOBALS", "SafeFileSystemReader", "SavedOptimizer", "ShardLoadPlanner",
    "ShardSavePlanner", "boxes", "buffers", "check_loadable", "clean_stale", "consolidate", "consolidated",
    "consolidated_dict", "content_sha256", "full_tensors", "identify_frozen", "is_checkpoint", "is_complete", "load",
    "load_file", "load_full_state_dict", "model_entries", "on_first_rank", "optimizer_entries", "read_dcp_metadata",
    "read_info", "read_manifest", "read_meta", "remove", "restore_sampler_states", "safe_load", "save",
    "set_aside_sampler_states", "single_file_staging", "state_dict_aliases", "verify", "verify_file", "write_file",
]
