"""A fit's checkpoints as Lightning asks for them: saved sharded (or consolidated), loaded in any layout.

Each rank writes and reads its own pieces (:mod:`cephalo_lightning.runtime.checkpoint`); the
optimizer state is saved with the model, by logical tensor, so a checkpoint loads back under any
plan and world size. With ``checkpoint_frozen=False`` a checkpoint holds the trainable parameters
alone (with their optimizer state and the loops) and what identifies the frozen base read from
``pretrained=`` (:mod:`~cephalo_lightning.runtime.checkpoint.frozen_base`); a resume reads that base
again and loads the rest:

    checkpoint bytes = trainable parameters x (master bytes + optimizer state bytes) + the loops
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from cephalo_lightning.lightning.strategy_config import StrategyConfig
from cephalo_lightning.planner import Plan
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.checkpoint.async_save import BackgroundWriter, writer_group
from cephalo_lightning.runtime.checkpoint.frozen_base import INFO_KEY as FROZEN_BASE_KEY
from cephalo_lightning.runtime.checkpoint.frozen_base import FrozenBase, identify_frozen
from cephalo_lightning.runtime.checkpoint.save_load import write_prepared
from cephalo_lightning.runtime.pipelining.runner import PipelineRunner
from cephalo_lightning.runtime.pipelining.stage_checkpoint import prepare_stages
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel

LIGHTNING_SAFE_GLOBALS: tuple[Any, ...] = (AttributeDict,)  # Lightning's hyperparameter container


def globals_with_lightning(extra: Sequence[Any] = ()) -> tuple[Any, ...]:
    """What a checkpoint of a Lightning fit may hold besides the runtime's allow-list."""
    return (*LIGHTNING_SAFE_GLOBALS, *extra)


def consolidated(path: str | Path, safe_globals: Sequence[Any] = ()) -> io.BytesIO:
    """A sharded checkpoint directory as one in-memory Lightning checkpoint file, e.g. for
    ``LightningModule.load_from_checkpoint(consolidated(DIR))`` (verified first)."""
    buffer = io.BytesIO()
    consolidate(path, buffer, safe_globals)
    buffer.seek(0)
    return buffer


def consolidate(path: str | Path, output: str | Path | io.BytesIO, safe_globals: Sequence[Any] = ()) -> str | None:
    """Write a sharded checkpoint directory as one ordinary Lightning checkpoint file (verified first)
    that any strategy resumes from; logs, and returns, what moving off Cephalo keeps (None when the
    checkpoint holds no sampler position)."""
    note = checkpoint.consolidate(path, output, globals_with_lightning(safe_globals))
    if note is not None:
        rank_zero_info(note)
    return note


class FitCheckpoints:
    """Saves and loads the sharded model (and its optimizer state) of one fit; with
    ``async_checkpoint`` the saves are written in the background (:class:`~.checkpoint.BackgroundWriter`)."""

    def __init__(self, sharded: ShardedModel, config: StrategyConfig, rank: int, plan: Callable[[], Plan],
                 model_info: dict[str, Any] | None = None, stage: PipelineRunner | None = None) -> None:
        self.sharded = sharded
        self.stage = stage  # a pipelined plan's: the checkpoint is written over every stage
        self.model_info = model_info or {}  # recorded in cephalo.json (a Hugging Face model's config, for export)
        self.config = config
        self.safe_globals = globals_with_lightning(config.safe_globals)
        self.rank = rank
        self.plan = plan  # the plan the model is sharded under when a checkpoint is written
        self.writer: BackgroundWriter | None = None
        self._frozen: FrozenBase | None = None  # this run's frozen base, once a save or a load asked for it
        if config.async_checkpoint:  # collective (the writer's own process group): at setup, on every rank
            self.writer = BackgroundWriter(sharded, writer_group(sharded.world_group))
            rank_zero_info("Cephalo: checkpoints are written in the background (async_checkpoint=True): training "
                           "waits only for the copy to host memory")

    def newest_complete(self, submitted: Path) -> Path | None:
        """The newest checkpoint known to be complete: ``submitted`` itself, unless it is still being written."""
        return submitted if self.writer is None else self.writer.published

    def wait(self) -> None:
        """Return when every save submitted is written and published (raises a failed one's error)."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    def remove(self, path: str | Path) -> None:
        """Rank 0: delete a checkpoint, after any save submitted before it has published."""
        if self.writer is not None:
            self.writer.remove(path)
        else:
            checkpoint.remove(path)

    def save(self, path: Path, checkpoint_dict: dict[str, Any], optimizers: Sequence[Optimizer]) -> Path:
        """Collective: a sharded checkpoint directory, or with ``state_dict_type="full"`` one file
        (consolidated on rank 0 from a sharded one written beside it). ``checkpoint_dict`` without
        ``optimizer_states`` (``save_weights_only``) saves no optimizer state."""
        meta = {k: v for k, v in checkpoint_dict.items() if k not in ("state_dict", "optimizer_states")}
        info = {"plan": self.plan().to_dict(), "world_size": self.plan().world_size, **self.model_info}
        optimizers = optimizers if "optimizer_states" in checkpoint_dict else []
        trainable_only = not self.config.checkpoint_frozen
        if trainable_only:  # the frozen parameters come from pretrained= at resume: say which ones
            info[FROZEN_BASE_KEY] = self.frozen_base().to_dict()
        if self.stage is not None:  # every stage's pieces under their names in the model, in one save
            return write_prepared(path, prepare_stages(self.stage, optimizers, meta, self.safe_globals), info, None)
        if self.writer is not None:
            return self.writer.submit(path, optimizers, meta, info, self.safe_globals, trainable_only)
        if self.config.state_dict_type == "sharded":
            return checkpoint.save(path, self.sharded, optimizers, meta, info, self.safe_globals, trainable_only)
        staging = checkpoint.single_file_staging(path)
        checkpoint.save(staging, self.sharded, optimizers, meta, info, self.safe_globals)
        checkpoint.on_first_rank(self.sharded.world_group, lambda: self._consolidate(staging, path))
        return path

    def _consolidate(self, staging: Path, path: Path) -> None:
        try:
            full = checkpoint.consolidated_dict(staging, self.safe_globals, verify_checksums=False)  # hashed by save
            checkpoint.remove(staging)  # before the file is written: the disk holds one copy at a time
            checkpoint.set_aside_sampler_states(full)  # any strategy resumes from it; load_full puts it back
            checkpoint.write_file(full, path)
        finally:
            checkpoint.remove(staging)

    def frozen_base(self) -> FrozenBase:
        """Collective (the first time): what identifies this run's frozen parameters, read from
        ``pretrained=``; they do not change while it trains (:meth:`forget_frozen_base` after edits)."""
        if self._frozen is None:
            self._frozen = identify_frozen(self.sharded, str(self.config.pretrained))
        return self._frozen

    def forget_frozen_base(self) -> None:
        """The module's whole parameters went back into the shards (edits included): fingerprint again."""
        self._frozen = None

    def _pretrained_base(self) -> FrozenBase | None:
        return self.frozen_base() if self.config.pretrained is not None else None

    def load(self, path: Path, optimizers: Sequence[Optimizer], weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: a sharded directory (any layout) or a single file (weights only)."""
        trusted = weights_only is False  # an explicit opt-in to unpickling meta.pt (never DCP's metadata)
        self.wait()  # a checkpoint being written in the background is complete first
        if path.is_dir() or checkpoint.is_checkpoint(path) or not path.exists():
            meta, _ = checkpoint.load(path, self.sharded, optimizers, self.safe_globals,
                                      self.config.verify_checksums, trusted=trusted, frozen=self._pretrained_base,
                                      rename=self.stage.canonical if self.stage is not None else None)
            return meta
        if self.stage is not None:
            raise checkpoint.CheckpointError(f"{path} is a single-file checkpoint, which a pipelined plan does not load "
                                             "yet: resume from a sharded checkpoint directory, or under a plan without "
                                             "pipelines (CephaloStrategy(pipelines=False) where it plans from a "
                                             "cluster file)")
        rank_zero_info("Cephalo: loading weights from a single-file checkpoint; optimizer state starts fresh.")
        return self.load_full(path, trusted)

    def load_full(self, path: Path, trusted: bool = False) -> dict[str, Any]:
        """Weights from a single-file checkpoint (optimizer state starts fresh), checked against
        the checksum it carries when cephalo wrote it."""
        loaded, checked = checkpoint.load_file(path, self.safe_globals, trusted=trusted)
        if not checked:
            rank_zero_info(f"Cephalo: {path} carries no integrity record (not written by cephalo-lightning); "
                           "loaded unchecked.")
        checkpoint.restore_sampler_states(loaded)  # a consolidated file: Cephalo continues on its samples
        state = loaded.get("state_dict", loaded)
        with torch.no_grad():
            for name, piece in self.sharded.named_parameters():
                if name not in state:
                    raise checkpoint.CheckpointError(f"{path} has no weights for {name!r}")
                unit = next(u for u in self.sharded.units if any(s.name == name for s in u.spans))
                index = [s.name for s in unit.spans].index(name)
                start, stop = unit.local_range(index)
                piece.copy_(state[name].reshape(-1)[start:stop].view(piece.shape))
        return {k: v for k, v in loaded.items() if k not in ("optimizer_states", "state_dict")}
