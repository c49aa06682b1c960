"""Nothing silent, nothing leaked: a damaged single file, a manifest with a gap, files of two
checkpoints under one manifest are refused by name; a full disk is named, what the failed save
wrote is removed and the previous checkpoint stays loadable."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from cephalo_lightning import CephaloStrategy, consolidated
from cephalo_lightning._common import atomic_io
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.checkpoint import CheckpointError, NoSpaceError
from tests import helpers
from tests.distributed import run_distributed
from tests.helpers import max_error
from tests.lightning_models import TinyLayered, loader, token_data
from tests.plans import plan_of

GLOBAL = 12
PLAN = plan_of(batches=[GLOBAL], micro=[2], shares=[1.0])


def _trainer(steps: int, callbacks=(), **strategy):
    return helpers.trainer(CephaloStrategy(plan=PLAN, **strategy), 1, steps, callbacks=list(callbacks))


def _data():
    return loader(token_data(36), GLOBAL)


class _SaveAt(Callback):
    """trainer.save_checkpoint at the given optimizer steps, as ``step=N.ckpt``."""

    def __init__(self, directory: Path, steps: tuple[int, ...]) -> None:
        self.directory, self.steps = directory, steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(self.directory / f"step={trainer.global_step}.ckpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One sharded fit saving at steps 1 and 3, one single-file fit saving after 1 step; the
    trainers stay usable for more saves."""
    warnings.simplefilter("ignore")
    root = tmp_path_factory.mktemp("integrity")
    sharded = _trainer(3, callbacks=[_SaveAt(root, (1, 3))])
    sharded.fit(TinyLayered(), _data())
    full = _trainer(1, state_dict_type="full")
    full.fit(TinyLayered(), _data())
    full.save_checkpoint(root / "export.ckpt")
    return {"root": root, "sharded": sharded, "full": full}


def _copy(saved, name: str, into: Path) -> Path:
    source = saved["root"] / name
    target = into / name
    shutil.copytree(source, target) if source.is_dir() else shutil.copy(source, target)
    return target


def _resume(path: Path) -> None:
    _trainer(4).fit(TinyLayered(), _data(), ckpt_path=str(path))


# ----------------------------------------------------------------------------- a single file vouches for itself


def _tensor_offset(path: Path) -> int:
    """Where the bytes of the file's largest tensor start (a byte there is tensor data, nothing else)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length + info.file_size // 2


def test_a_flipped_byte_in_a_single_file_is_refused_naming_it(saved, tmp_path):
    file = _copy(saved, "export.ckpt", tmp_path)
    checkpoint.verify_file(file)  # intact: checked and accepted
    before = torch.load(file, weights_only=True)
    data = bytearray(file.read_bytes())
    data[_tensor_offset(file)] ^= 0x10
    file.write_bytes(bytes(data))
    after = torch.load(file, weights_only=True)  # what torch (and load_from_checkpoint) cannot see
    changed = [k for k in before["state_dict"] if not torch.equal(before["state_dict"][k], after["state_dict"][k])]
    assert len(changed) == 1 and int((before["state_dict"][changed[0]] != after["state_dict"][changed[0]]).sum()) == 1
    with pytest.raises(CheckpointError, match=rf"{file.name}: its content does not match the checksum"):
        _resume(file)
    with pytest.raises(CheckpointError, match=rf"{file.name}: its content does not match the checksum"):
        checkpoint.verify_file(file)
    assert checkpoint.INTEGRITY_KEY in before  # the record: an ordinary Lightning file with one more key


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_truncated_or_garbage_single_file_is_refused_naming_it(saved, tmp_path, damage):
    file = _copy(saved, "export.ckpt", tmp_path)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match=rf"{file.name} (cannot be read|.*or is not a checkpoint file)"):
        _resume(file)


def test_a_file_without_a_record_still_loads_and_verify_file_says_it_cannot_tell(saved, tmp_path):
    plain = torch.load(saved["root"] / "export.ckpt", weights_only=True)
    del plain[checkpoint.INTEGRITY_KEY]  # as Lightning or another strategy writes it
    torch.save(plain, tmp_path / "plain.ckpt")
    _resume(tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointError, match="carries no integrity record"):
        checkpoint.verify_file(tmp_path / "plain.ckpt")


# ----------------------------------------------------------------------------- every file vouched for, one save


def _regenerate_manifest(path: Path, drop: str = "", token: str | None = None) -> None:
    """What a careless tool does: a manifest over whatever the directory holds now."""
    files = {p.name: {"size": p.stat().st_size, "sha256": checkpoint._sha256(p)}
             for p in path.iterdir() if p.is_file() and p.name not in ("manifest.json", drop)}
    document = {"format": checkpoint.FORMAT, "files": files, **({"token": token} if token else {})}
    (path / "manifest.json").write_text(json.dumps(document))


def _victim(path: Path, victim: str) -> Path:
    return next(p for p in path.iterdir() if p.name.endswith(victim))


@pytest.mark.parametrize("victim", ["distcp", ".metadata", "meta.pt", "cephalo.json"])
def test_a_file_missing_from_the_manifest_is_refused_naming_it(saved, tmp_path, victim):
    ckpt = _copy(saved, "step=3.ckpt", tmp_path)
    file = _victim(ckpt, victim)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"][file.name]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    if victim == "distcp":  # and damage it: unlisted, nothing else would notice
        data = bytearray(file.read_bytes())
        data[-100] ^= 0x10
        file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{file.name} is read by a load but is not in the manifest"):
        checkpoint.load_full_state_dict(ckpt)
    if victim == "distcp":
        with pytest.raises(CheckpointError, match=rf"{file.name} is read by a load but is not in the manifest"):
            _resume(ckpt)


@pytest.mark.parametrize("victim", ["distcp", ".metadata", "meta.pt", "cephalo.json"])
def test_files_of_two_checkpoints_under_a_regenerated_manifest_are_refused(saved, tmp_path, victim):
    """step=1's file copied into step=3, the manifest regenerated over the mix (even with step=3's token)."""
    early, late = _copy(saved, "step=1.ckpt", tmp_path), _copy(saved, "step=3.ckpt", tmp_path)
    token = json.loads((late / "manifest.json").read_text()).get("token")
    shutil.copy(_victim(early, victim), late / _victim(early, victim).name)
    _regenerate_manifest(late, token=token)
    checkpoint.verify(early)  # the source is untouched and whole
    with pytest.raises(CheckpointError, match="mixes files of two checkpoints"):
        consolidated(late)
    with pytest.raises(CheckpointError, match="mixes files of two checkpoints"):
        _resume(late)


def test_a_whole_checkpoint_with_a_regenerated_manifest_still_loads(saved, tmp_path):
    ckpt = _copy(saved, "step=3.ckpt", tmp_path)
    _regenerate_manifest(ckpt)  # the same files: nothing mixed, nothing unlisted
    want = checkpoint.load_full_state_dict(saved["root"] / "step=3.ckpt")
    assert max_error(checkpoint.load_full_state_dict(ckpt), want) == 0.0


# ----------------------------------------------------------------------------- a full disk


class _FullDisk:
    """Writes to real files fail with ENOSPC after ``budget`` bytes, as a full disk does."""

    def __init__(self, stream, budget: int) -> None:
        self.stream, self.budget = stream, budget

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        room = max(0, min(self.budget, len(data)))
        self.stream.write(data[:room])
        self.budget -= room
        if room < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()


def _full_disk_torch_save(real):
    """DCP writes each tensor with torch.save into the open shard file: that write fails."""

    def save(obj, target, *args, **kwargs):
        if isinstance(target, io.BytesIO):
            return real(obj, target, *args, **kwargs)
        return real(obj, _FullDisk(target, 64), *args, **kwargs)

    return save


def _full_disk_open(real, prefix: str, seen: list, directory: Path):
    """``open`` for the atomic writes: the temporary file of ``prefix`` fills the disk."""

    def open_(path, mode="r", *args, **kwargs):
        handle = real(path, mode, *args, **kwargs)
        if Path(path).name.startswith(prefix):
            seen.append(_hidden(directory))
            return _FullDisk(handle, 100)
        return handle

    return open_


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_full_disk_during_a_sharded_save_is_named_cleaned_up_and_the_previous_checkpoint_loads(saved, tmp_path,
                                                                                                 monkeypatch):
    trainer = saved["sharded"]
    last = tmp_path / "last.ckpt"
    trainer.save_checkpoint(last)
    want = checkpoint.load_full_state_dict(last)
    monkeypatch.setattr(torch, "save", _full_disk_torch_save(torch.save))
    with pytest.raises(NoSpaceError) as caught:
        trainer.save_checkpoint(last)
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, OSError)
    message = str(caught.value)
    assert "no space left on device" in message and str(last) in message and "needs about" in message, message
    assert "had been written" in message and "was removed" in message, message
    assert _hidden(tmp_path) == []  # the staging directory is gone
    monkeypatch.undo()
    checkpoint.verify(last)
    assert max_error(checkpoint.load_full_state_dict(last), want) == 0.0
    _resume(last)


@pytest.mark.parametrize("stage", ["the sharded copy", "the single file"])
def test_a_full_disk_during_a_single_file_save_leaves_no_hidden_copy_and_the_previous_file(saved, tmp_path,
                                                                                           monkeypatch, stage):
    trainer = saved["full"]
    file = tmp_path / "export.ckpt"
    trainer.save_checkpoint(file)
    previous = file.read_bytes()
    seen: list[list[str]] = []
    if stage == "the sharded copy":
        monkeypatch.setattr(torch, "save", _full_disk_torch_save(torch.save))
    else:  # the single file's temporary copy fills the disk
        monkeypatch.setattr(atomic_io, "open", _full_disk_open(open, ".export.ckpt.tmp-", seen, tmp_path), raising=False)
    with pytest.raises(NoSpaceError, match=rf"no space left on device \(errno ENOSPC\) .*{file.name}"):
        trainer.save_checkpoint(file)
    if seen:  # the sharded copy was removed before the file was written: one copy on disk at a time
        assert all(not name.endswith(".sharded") and "staging" not in name for name in seen[0]), seen
    monkeypatch.undo()
    assert _hidden(tmp_path) == []
    assert file.read_bytes() == previous
    checkpoint.verify_file(file)


def test_clean_stale_removes_a_leaked_single_file_staging_directory(saved, tmp_path):
    kept = _copy(saved, "step=3.ckpt", tmp_path)
    shutil.copytree(kept, tmp_path / ".export.ckpt.sharded")  # what an interrupted single-file save leaves
    (tmp_path / ".export.ckpt.tmp-0123abcd").write_bytes(b"partial")
    checkpoint.clean_stale(tmp_path)
    assert _hidden(tmp_path) == []
    checkpoint.verify(kept)


PLAN2 = plan_of(batches=[8, 4], micro=[2, 1], shares=[0.3, 0.7])


def _full_disk_on_one_rank(rank: int, world: int, root: str):
    """A save whose DCP write fills the disk on rank 1 only, then one whose meta.pt (rank 0's) does."""
    warnings.simplefilter("ignore")
    root_path = Path(root)
    trainer = helpers.trainer(CephaloStrategy(plan=PLAN2), world, 1)
    trainer.fit(TinyLayered(), _data())
    last = root_path / "last.ckpt"
    trainer.save_checkpoint(last)
    want = checkpoint.load_full_state_dict(last)
    patches = {"dcp": (torch, "save", _full_disk_torch_save(torch.save), 1),
               "meta": (atomic_io, "open", _full_disk_open(open, ".meta.pt.tmp-", [], root_path), 0)}
    out = {}
    for name, (owner, attr, replacement, failing) in patches.items():
        with mock.patch.object(owner, attr, replacement, create=True) if rank == failing else contextlib.nullcontext():
            try:
                trainer.save_checkpoint(last)
                out[name] = None
            except Exception as err:  # noqa: BLE001 - compared by the test
                out[name] = (type(err).__name__, str(err), getattr(err, "errno", None))
        trainer.strategy.barrier()
        out[name + " leftovers"] = _hidden(root_path)
    out["previous"] = max_error(checkpoint.load_full_state_dict(last), want)
    return out


@pytest.mark.multiprocess
def test_a_full_disk_on_one_rank_fails_every_rank_alike_and_leaves_the_previous_checkpoint(tmp_path):
    for rank, out in enumerate(run_distributed(_full_disk_on_one_rank, 2, str(tmp_path))):
        for name in ("dcp", "meta"):
            assert out[name] is not None, f"rank {rank}: the {name} save did not fail"
            kind, message, code = out[name]
            assert kind == "NoSpaceError" and code == errno.ENOSPC, (rank, name, out[name])
            assert "no space left on device" in message and "last.ckpt" in message, message
            assert out[name + " leftovers"] == [], (rank, name, out)
        assert out["previous"] == 0.0
