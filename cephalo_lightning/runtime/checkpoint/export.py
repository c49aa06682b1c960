"""A sharded checkpoint as a Hugging Face ``save_pretrained`` directory, one unit at a time.

``python -m cephalo_lightning export CHECKPOINT_DIR --hf OUT`` writes ``config.json`` and the
weights as safetensors files (``model.safetensors``, or numbered files with
``model.safetensors.index.json`` when there are several), so ``AutoModel*.from_pretrained(OUT)``
gives the trained weights bit for bit (in the master dtype they were trained in).

Where things come from: the checkpoint records, for a fit of a Hugging Face model, the model's
config, its class and the attribute path of the model inside the LightningModule (``cephalo.json``
key ``hf``); ``--config`` (a ``config.json`` or a model directory) and ``--prefix`` stand in for a
checkpoint without them. The checkpoint is verified first (sizes and SHA-256) and read without
executing code (:mod:`.safe_load`); tensors are read unit by unit, as the fit sharded them, and
each file is written and released before the next is read, so the peak memory is about one
output file (``max_shard_bytes``), not the model. The output appears whole or not at all
(written beside it, then renamed).

A fit of a peft LoRA model records its LoRA layers (key ``hf.lora``): their adapters are merged
into the base weights unit by unit (:mod:`.lora_merge`), so the output is the plain model under
its original names, what ``merge_and_unload()`` then ``save_pretrained`` would write
(``merge_lora=False``, ``--no-merge``: the tensors as stored, peft's names and the adapters).

A fit whose frozen matrices were stored as 4-bit NF4 blocks (QLoRA; ``cephalo.json`` key
``nf4_base``) saved them dequantised (exact in fp32); the export merges the adapters into that
dequantised base and writes every tensor in bf16 (``torch_dtype`` too): the 4-bit model is not
written as such, and :attr:`Exported.dequantised` (printed by the command) says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from cephalo_lightning._common.atomic_io import publish_directory, remove_tree
from cephalo_lightning.runtime.checkpoint.dcp_planners import Request, ShardLoadPlanner, dcp_call
from cephalo_lightning.runtime.checkpoint.format import MODEL_PREFIX, NF4_KEY, CheckpointError
from cephalo_lightning.runtime.checkpoint.frozen_base import refuse_without_base
from cephalo_lightning.runtime.checkpoint.lora_merge import merge
from cephalo_lightning.runtime.checkpoint.manifest import read_info, verify
from cephalo_lightning.runtime.checkpoint.safe_load import SafeFileSystemReader, read_dcp_metadata

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Exported:
    """What :func:`export_hf` wrote."""

    output: Path
    files: tuple[str, ...]
    tensors: int
    skipped: tuple[str, ...]  # stored tensors outside the Hugging Face model (other LightningModule parts)
    dequantised: tuple[str, ...] = ()  # the base's matrices the fit stored as 4-bit NF4 blocks (written in bf16)

    @property
    def note(self) -> str | None:
        """What the export did to a 4-bit base, for the command's output (None: nothing)."""
        if not self.dequantised:
            return None
        return (f"the base was stored as 4-bit NF4 blocks ({len(self.dequantised)} matrices): exported dequantised, "
                "with the adapters merged into it, in bf16")


def _hf_source(info: dict[str, Any], config: str | Path | None, prefix: str | None) -> tuple[dict[str, Any], str]:
    """The model's config (a dict) and the name prefix of its weights in the checkpoint."""
    recorded = info.get("hf") or {}
    if config is not None:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise CheckpointError(f"--config {config}: no such file (give a config.json or a directory holding one)")
        document = json.loads(path.read_text())
    elif "config" in recorded:
        document = dict(recorded["config"])
    else:
        raise CheckpointError(
            "the checkpoint records no Hugging Face config (not a fit of a transformers model, or written by an "
            "older version): pass --config PATH (a config.json or the model's directory) and --prefix ATTR. (the "
            "attribute holding the model in your LightningModule, e.g. 'model.')")
    if recorded.get("class") and not document.get("architectures"):
        document["architectures"] = [recorded["class"]]
    chosen = prefix if prefix is not None else recorded.get("prefix", "")
    return document, chosen


def _groups(info: dict[str, Any], stored: Sequence[str]) -> list[list[str]]:
    """The stored model tensors (names without ``model.``) in the fit's units, then the rest (buffers)."""
    units = info.get("units") or [list(info.get("param_shapes", {}))]
    known = set(stored)
    groups = [[name for name in unit if name in known] for unit in units]
    seen = {name for group in groups for name in group}
    rest = [name for name in stored if name not in seen]
    return [g for g in groups if g] + ([rest] if rest else [])


def _read(path: Path, metadata: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Whole tensors ``names`` (without the ``model.`` prefix) from the checkpoint: one DCP read."""
    out, requests = {}, []
    for name in names:
        md = metadata[MODEL_PREFIX + name]
        out[name] = tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        requests.append(Request(MODEL_PREFIX + name, tuple(md.size), tensor.view(-1), 0))
    dcp_call(f"reading {path}", lambda: dcp.load({}, storage_reader=SafeFileSystemReader(path),
                                                 planner=ShardLoadPlanner(requests), no_dist=True))
    return out


def _batches(groups: list[list[str]], sizes: dict[str, int], budget: int) -> Iterator[list[str]]:
    """Units packed into output files of at most ``budget`` bytes (a bigger unit gets a file alone)."""
    batch: list[str] = []
    used = 0
    for group in groups:
        size = sum(sizes[n] for n in group)
        if batch and used + size > budget:
            yield batch
            batch, used = [], 0
        batch += group
        used += size
    if batch:
        yield batch


def export_hf(checkpoint: str | Path, output: str | Path, *, config: str | Path | None = None,
              prefix: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              verify_checksums: bool = True, merge_lora: bool = True) -> Exported:
    """Write the checkpoint's Hugging Face model as a ``save_pretrained`` directory (see the module docstring)."""
    from safetensors.torch import save_file

    source, output = Path(checkpoint), Path(output)
    if not source.is_dir():
        raise CheckpointError(f"{source} is not a sharded checkpoint directory")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(f"{output} exists and is not empty; choose another output directory or remove it first")
    verify(source, checksums=verify_checksums, collective=False)
    info = read_info(source)
    refuse_without_base(source, info, "export the whole model")
    document, chosen = _hf_source(info, config, prefix)
    metadata = read_dcp_metadata(source).state_dict_metadata
    stored = [fqn[len(MODEL_PREFIX):] for fqn in metadata if fqn.startswith(MODEL_PREFIX)]
    aliases = {saved: [a for a, s in info.get("aliases", {}).items() if s == saved] for saved in stored}
    inside = [name for name in stored if name.startswith(chosen)]
    skipped = tuple(name for name in stored if not name.startswith(chosen))
    if not inside:
        raise CheckpointError(f"no tensor of {source} is under the prefix {chosen!r}; pass --prefix (e.g. 'model.')")
    sizes = {n: metadata[MODEL_PREFIX + n].properties.dtype.itemsize * _numel(metadata[MODEL_PREFIX + n].size)
             for n in inside}
    batches = list(_batches(_groups(info, inside), sizes, max_shard_bytes))
    lora = (info.get("hf") or {}).get("lora") or {} if merge_lora else {}
    dequantised = tuple(name for name in info.get(NF4_KEY, ()) if name.startswith(chosen))
    if dequantised:
        document = {**document, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    staging = output.with_name(output.name + ".exporting")
    if staging.exists():  # what an interrupted export left
        remove_tree(staging)
    staging.mkdir(parents=True)
    try:
        files, weight_map, count, total = [], {}, 0, 0
        for index, names in enumerate(batches, start=1):
            file = "model.safetensors" if len(batches) == 1 else f"model-{index:05d}-of-{len(batches):05d}.safetensors"
            tensors = {}
            for name, tensor in _read(source, metadata, names).items():
                for key in (name, *(a for a in aliases[name] if a.startswith(chosen))):
                    tensors[key[len(chosen):]] = tensor if key == name else tensor.clone()
            if lora:
                tensors = merge(tensors, lora)
            if dequantised:
                tensors = {key: t.to(torch.bfloat16) if t.is_floating_point() else t for key, t in tensors.items()}
            save_file(tensors, str(staging / file), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({key: file for key in tensors})
            files.append(file)
            count += len(tensors)
            del tensors
        if len(files) > 1:
            index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_FILE).write_text(json.dumps(index_doc, indent=2))
        (staging / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True))
        generation = (info.get("hf") or {}).get("generation_config")
        if generation and config is None:
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
        publish_directory(staging, output)
    except BaseException:
        remove_tree(staging)
        raise
    return Exported(output, tuple(files), count, skipped, dequantised)


def _numel(size: Sequence[int]) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n
