"""Pretrained weights read straight into the shards: each rank reads only its own slices.

A model built on the meta device is materialised unit by unit (:class:`~.materialize.UnitMaterializer`);
with a :class:`WeightSource` each rank reads, for every parameter, only the elements its shard
owns: from safetensors files (a Hugging Face ``save_pretrained`` directory, sharded or not) through
safetensors' slicing, or from a ``state_dict`` file opened memory-mapped (pages not read are never
loaded). Files are opened without running code (safetensors; ``torch.load(weights_only=True)``).

Names: parameters are looked up by their name in the model being trained and, failing that, with
``prefix`` removed (a LightningModule that holds the library model as ``self.model`` has names
``model.<hf name>``, a ``save_pretrained`` directory the bare ``<hf name>``), each also with the
name segments in ``wrapped`` removed (a peft LoRA layer holds the original linear as
``base_layer``: ``q_proj.base_layer.weight`` is the file's ``q_proj.weight``).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from cephalo_lightning._common.errors import CephaloError


class WeightsError(CephaloError, ValueError):
    """The weights cannot be read into this model: which tensor, what is wrong, what to do."""


def _row_range(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, int, int]:
    """Rows of the first dimension covering flat elements [start, stop), and the row length."""
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    return start // inner, -(-stop // inner), inner


class WeightSource:
    """Base: maps model names to stored keys and checks shapes; subclasses read the bytes."""

    def __init__(self, keys: dict[str, tuple[int, ...]], prefix: str = "", where: str = "",
                 wrapped: tuple[str, ...] = ()) -> None:
        self.keys = keys  # stored key -> shape
        self.prefix = prefix
        self.where = where
        self.wrapped = wrapped
        self.used: set[str] = set()

    def _key(self, name: str) -> str | None:
        names = [name]
        if self.prefix and name.startswith(self.prefix):
            names.append(name[len(self.prefix):])
        for candidate in names:
            for form in (candidate, self._unwrapped(candidate)):
                if form in self.keys:
                    return form
        return None

    def _unwrapped(self, name: str) -> str:
        for segment in self.wrapped:
            name = name.replace(segment + ".", ".")
        return name

    def holds(self, name: str) -> bool:
        """Whether the files hold a tensor for parameter (or buffer) ``name``."""
        return self._key(name) is not None

    def read(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        key = self._key(name)
        if key is None:
            raise WeightsError(
                f"{self.where} has no tensor for parameter {name!r}"
                + (f" (nor {name[len(self.prefix):]!r})" if self.prefix and name.startswith(self.prefix) else "")
                + f"; it holds {len(self.keys)} tensors, e.g. {sorted(self.keys)[:3]}. Check that the weights are "
                "for this model (and its configuration)"
            )
        stored = self._checked(key, name, shape)
        return self._read(key, stored, start, stop)

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The whole buffer ``name``, or None when the files do not hold it (non-persistent)."""
        key = self._key(name)
        if key is None:
            return None
        stored = self._checked(key, name, shape)
        return self._read(key, stored, 0, math.prod(stored)).view(shape)

    def _checked(self, key: str, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of ``key``, refused unless it holds the model's ``shape`` (same sizes, or
        the same elements in another number of dimensions); marks the tensor used."""
        stored = tuple(self.keys[key])
        if math.prod(stored) != math.prod(shape) or (stored != tuple(shape) and len(stored) == len(shape)):
            raise WeightsError(f"{self.where}: {key!r} has shape {list(stored)} but the model's {name!r} is {list(shape)}")
        self.used.add(key)
        return stored

    def unused(self, used_by_ranks: Iterable[Iterable[str]] = ()) -> list[str]:
        """The stored tensors no rank read, by this rank's ``used`` and every set in ``used_by_ranks``
        (the other ranks', gathered): a rank reads only the tensors its shards hold part of, so under
        uneven shares what one rank left unread another may have read."""
        read = set(self.used).union(*map(set, used_by_ranks))
        return sorted(set(self.keys) - read)

    def _read(self, key: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass


def _is_safetensors(path: Path) -> bool:
    return path.is_dir() or path.suffix == ".safetensors"


def check_readable(path: str | Path) -> None:
    """Refuse, before any work is done, weights this environment cannot read: safetensors files
    need the optional package ``safetensors`` (the ``hf`` extra)."""
    path = Path(path)
    if not _is_safetensors(path):
        return
    try:
        import safetensors  # noqa: F401
    except ImportError as err:
        raise WeightsError(
            f"CephaloStrategy(pretrained={str(path)!r}) reads safetensors files, but the package `safetensors` is "
            'not installed: pip install "cephalo-lightning[hf]" (or pip install safetensors), or give a state_dict '
            "file (torch.save(model.state_dict(), 'weights.pt')) instead"
        ) from err


class SafetensorsSource(WeightSource):
    """A ``save_pretrained`` directory (``model.safetensors`` or an index of shards), or one file."""

    def __init__(self, path: str | Path, prefix: str = "", wrapped: tuple[str, ...] = ()) -> None:
        check_readable(path)
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            elif (path / "model.safetensors").is_file():
                files = ["model.safetensors"]
            else:
                raise WeightsError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
            paths = [path / f for f in files]
        else:
            paths = [path]
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        keys: dict[str, tuple[int, ...]] = {}
        for file in paths:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            for key in handle.keys():
                self._handles[key] = handle
                keys[key] = tuple(handle.get_slice(key).get_shape())
        super().__init__(keys, prefix, str(path), wrapped)

    def _read(self, key: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        piece = self._handles[key].get_slice(key)
        if not shape:
            return piece[:].reshape(-1)[start:stop]
        r0, r1, inner = _row_range(shape, start, stop)
        rows = piece[r0:r1]
        return rows.reshape(-1)[start - r0 * inner : stop - r0 * inner]

    def close(self) -> None:
        self._stack.close()


class StateDictSource(WeightSource):
    """A file holding a ``state_dict`` (or a Lightning checkpoint with one), memory-mapped."""

    def __init__(self, path: str | Path, prefix: str = "", wrapped: tuple[str, ...] = ()) -> None:
        path = Path(path)
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:
            raise WeightsError(f"{path} cannot be read as a state_dict without running code ({err})") from err
        state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
        if not isinstance(state, dict):
            raise WeightsError(f"{path} does not hold a state_dict (found {type(loaded).__name__})")
        self._tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
        super().__init__({k: tuple(v.shape) for k, v in self._tensors.items()}, prefix, str(path), wrapped)

    def _read(self, key: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        return self._tensors[key].reshape(-1)[start:stop].clone()


def open_weights(path: str | Path, prefix: str = "", wrapped: tuple[str, ...] = ()) -> WeightSource:
    """The source for ``path``: safetensors (a directory or ``*.safetensors``) or a state_dict file."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"pretrained weights {path} do not exist")
    if _is_safetensors(path):
        return SafetensorsSource(path, prefix, wrapped)
    return StateDictSource(path, prefix, wrapped)
