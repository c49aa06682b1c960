"""Checkpoints users can trust and use: Lightning's own tools read them, nothing loaded runs code,
a damaged or half-written checkpoint is refused by name, kills never leave one that looks whole,
and every resume path trains on exactly the samples of the uninterrupted run."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import cephalo_lightning.lightning.fit.checkpoint_io
from cephalo_lightning import CephaloStrategy, Plan, consolidated
from cephalo_lightning.__main__ import main
from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.checkpoint import CheckpointError
from tests import helpers
from tests.conftest import clean_env
from tests.distributed import run_distributed
from tests.helpers import max_error
from tests.plans import plan_of
from tests.sgd_run import GLOBAL, PLAN2, SEED, TOTAL, SGDModule, data_loader, reference, sgd_on, sgd_trainer

ROOT = Path(__file__).resolve().parents[2]
OTHER2 = plan_of(batches=[3, 9], micro=[3, 2], shares=[0.9, 0.1])
PLAN3 = plan_of(batches=[5, 3, 4], micro=[1, 3, 2], shares=[0.2, 0.3, 0.5])


# ----------------------------------------------------------------------------- the resume matrix


def _first_halves(rank: int, world: int, root: str):
    """Write every checkpoint the resume paths start from (2 ranks, PLAN2)."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    warnings.simplefilter("ignore")
    out = {}
    for shuffle in (True, False):
        tag = "shuffled" if shuffle else "ordered"
        # ModelCheckpoint mid-epoch (step 3) and at the epoch boundary (step 5)
        saver = ModelCheckpoint(dirpath=f"{root}/{tag}", every_n_train_steps=1, save_top_k=-1, filename="{step}")
        t = sgd_trainer(PLAN2, world, 6, root, callbacks=[saver], enable_checkpointing=True)
        t.fit(SGDModule(), data_loader(shuffle))
        # fit() finished at max_steps mid-epoch, then trainer.save_checkpoint
        t = sgd_trainer(PLAN2, world, 3, root)
        t.fit(SGDModule(), data_loader(shuffle))
        t.save_checkpoint(f"{root}/{tag}/after-fit-3.ckpt")

        class SaveAt2(Callback):  # trainer.save_checkpoint from inside the loop
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 2:
                    trainer.save_checkpoint(f"{root}/{tag}/inside-2.ckpt")

        sgd_trainer(PLAN2, world, 4, root, callbacks=[SaveAt2()]).fit(SGDModule(), data_loader(shuffle))
    return out


def _resume(rank: int, world: int, cases: list[tuple[str, str, dict, bool]]):
    """Every resume case of one world size, one after the other in the same ranks: each case's
    (parameters, global step), or its traceback, so one broken path fails only its own test."""
    warnings.simplefilter("ignore")
    out = {}
    for name, ckpt, plan, shuffle in cases:
        try:
            t = sgd_trainer(Plan.from_dict(plan), world, TOTAL)
            t.fit(SGDModule(seed=3), data_loader(shuffle), ckpt_path=ckpt)  # another init: all must come from the file
            out[name] = (t.strategy.sharded.full_state_dict(), t.global_step)
        except Exception:  # noqa: BLE001 - reported by the case's own test
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def first_halves(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    run_distributed(_first_halves, 2, str(root))
    return root


RESUME_PATHS = [  # (name, checkpoint, shuffled, world, plan)
    ("mid-epoch, ModelCheckpoint, shuffled", "shuffled/step=3.ckpt", True, 2, PLAN2),
    ("mid-epoch, ModelCheckpoint, in order", "ordered/step=3.ckpt", False, 2, PLAN2),
    ("epoch boundary, shuffled", "shuffled/step=5.ckpt", True, 2, PLAN2),
    ("after fit() at max_steps, shuffled", "shuffled/after-fit-3.ckpt", True, 2, PLAN2),
    ("after fit() at max_steps, in order", "ordered/after-fit-3.ckpt", False, 2, PLAN2),
    ("trainer.save_checkpoint in the loop, shuffled", "shuffled/inside-2.ckpt", True, 2, PLAN2),
    ("another plan, same world size", "shuffled/step=3.ckpt", True, 2, OTHER2),
    ("another world size and plan", "shuffled/after-fit-3.ckpt", True, 3, PLAN3),
    ("another world size, epoch boundary, in order", "ordered/step=5.ckpt", False, 3, PLAN3),
]


@pytest.fixture(scope="module")
def resumed(first_halves) -> dict[str, object]:
    """Every resume path: one spawn per world size runs all of that size's cases."""
    out: dict[str, object] = {}
    for world in sorted({p[3] for p in RESUME_PATHS}):
        cases = [(name, str(first_halves / ckpt), plan.to_dict(), shuffle)
                 for name, ckpt, shuffle, w, plan in RESUME_PATHS if w == world]
        out.update(run_distributed(_resume, world, cases)[0])
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,ckpt,shuffle,world,plan", RESUME_PATHS, ids=[p[0] for p in RESUME_PATHS])
def test_every_resume_path_trains_on_the_uninterrupted_runs_samples(resumed, name, ckpt, shuffle, world, plan):
    result = resumed[name]
    assert not isinstance(result, str), result
    params, step = result
    assert step == TOTAL
    assert max_error(params, reference(TOTAL, shuffle)) <= 1e-7, name


# ----------------------------------------------------------------------------- Lightning's tools


@pytest.mark.multiprocess
def test_lightning_tools_read_a_sharded_checkpoint(first_halves, tmp_path):
    path = first_halves / "shuffled" / "step=3.ckpt"
    want = {k: v.float() for k, v in reference(3, True).items()}  # fp64 training, loaded into an fp32 module
    restored = SGDModule.load_from_checkpoint(consolidated(path))  # Lightning's own loader, in memory
    assert max_error({k: v for k, v in restored.state_dict().items()}, want) == 0.0
    out = tmp_path / "model.ckpt"
    assert main(["consolidate", str(path), "-o", str(out)]) == 0  # the command, in this process
    plain = torch.load(out, weights_only=True)
    assert max_error({k: v.float() for k, v in plain["state_dict"].items()}, want) == 0.0 and plain["global_step"] == 3
    assert plain["optimizer_states"][0]["param_groups"][0]["lr"] == 0.5
    lightning_out = tmp_path / "lightning.ckpt"
    tool = subprocess.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(path),
                           "--output_file", str(lightning_out)], capture_output=True, text=True, env=clean_env())
    assert tool.returncode == 0, tool.stderr
    assert max_error(SGDModule.load_from_checkpoint(lightning_out).state_dict(), want) == 0.0


# ----------------------------------------------------------------------------- nothing loaded runs code


class Hostile:
    """Unpickling it writes a marker file: proof that code from the file ran."""

    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _single_rank_checkpoint(path: Path) -> None:
    warnings.simplefilter("ignore")
    t = sgd_trainer(plan_of(batches=[GLOBAL], micro=[2], shares=[1.0]), 1, 1, str(path.parent))
    t.fit(SGDModule(), data_loader(False))
    t.save_checkpoint(str(path))


def _rewrite_manifest(path: Path) -> None:
    """What an attacker would do: make the tampered file's checksum match."""
    files = {p.name: {"size": p.stat().st_size, "sha256": checkpoint._sha256(p)}
             for p in path.iterdir() if p.is_file() and p.name != "manifest.json"}
    (path / "manifest.json").write_text(json.dumps({"format": checkpoint.FORMAT, "files": files}))


def _hostile_bytes(marker: Path) -> bytes:
    Hostile.marker = str(marker)
    return pickle.dumps({"epoch": 0, "evil": Hostile()})


LOAD_PATHS = {
    "Trainer.fit(ckpt_path=dir)": lambda p: sgd_trainer(plan_of(batches=[GLOBAL], micro=[2], shares=[1.0]),
                                                    1, 2).fit(SGDModule(), data_loader(False), ckpt_path=str(p)),
    "Trainer.fit(weights_only=True)": lambda p: sgd_trainer(plan_of(batches=[GLOBAL], micro=[2], shares=[1.0]),
                                                        1, 2).fit(SGDModule(), data_loader(False), ckpt_path=str(p),
                                                                  weights_only=True),
    "load_full_state_dict": lambda p: checkpoint.load_full_state_dict(p),
    "consolidated / load_from_checkpoint": lambda p: SGDModule.load_from_checkpoint(consolidated(p)),
    "read_meta": lambda p: checkpoint.read_meta(p),
}


@pytest.mark.parametrize("target", ["meta.pt", ".metadata"])
@pytest.mark.parametrize("path_name", sorted(LOAD_PATHS))
def test_a_hostile_pickle_never_runs_on_any_load_path(tmp_path, target, path_name):
    if target == ".metadata" and path_name == "read_meta":
        pytest.skip("read_meta reads meta.pt only")
    ckpt = tmp_path / "ckpt"
    _single_rank_checkpoint(ckpt)
    marker = tmp_path / "pwned"
    (ckpt / target).write_bytes(_hostile_bytes(marker))
    _rewrite_manifest(ckpt)
    reads_it = target == ".metadata" or path_name != "load_full_state_dict"  # that one needs no meta.pt
    try:
        LOAD_PATHS[path_name](ckpt)
        refused = None
    except CheckpointError as err:
        refused = str(err)
    assert not marker.exists(), f"{path_name}: code from {target} ran"
    if reads_it:
        assert refused and ("running code" in refused or "not one of DCP's metadata classes" in refused), refused


def test_a_hostile_single_file_checkpoint_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    file = tmp_path / "full.ckpt"
    Hostile.marker = str(marker)
    torch.save({"state_dict": {}, "evil": Hostile()}, file)
    with pytest.raises(CheckpointError, match="running code"):
        LOAD_PATHS["Trainer.fit(ckpt_path=dir)"](file)
    assert not marker.exists()


# ----------------------------------------------------------------------------- damage is refused by name


@pytest.mark.parametrize("victim", ["distcp", ".metadata", "meta.pt", "cephalo.json"])
def test_a_flipped_byte_in_any_file_is_a_clear_error_naming_it(tmp_path, victim):
    ckpt = tmp_path / "ckpt"
    _single_rank_checkpoint(ckpt)
    file = next(p for p in ckpt.iterdir() if p.name.endswith(victim))
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{file.name}.*checksum"):
        checkpoint.load_full_state_dict(ckpt)


class WithBuffer(SGDModule):
    """The same model with one more persistent buffer than the checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.arange(3.0))


def test_a_persistent_buffer_the_checkpoint_lacks_is_an_error_not_left_as_it_was(tmp_path):
    ckpt = tmp_path / "ckpt"
    _single_rank_checkpoint(ckpt)
    t = sgd_trainer(plan_of(batches=[GLOBAL], micro=[2], shares=[1.0]), 1, 2)
    with pytest.raises(CheckpointError, match=r"lacks parameters or buffers \['counts'\]"):
        t.fit(WithBuffer(), data_loader(False), ckpt_path=str(ckpt))


class FrozenBelowTheHead(SGDModule):
    """A fine-tune: every layer but the head frozen (read from ``pretrained=``), SGD with momentum."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        for name, p in self.named_parameters():
            p.requires_grad_(name.startswith("model.head."))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


def test_a_checkpoint_of_the_trainable_parameters_resumes_exactly_over_its_base(tmp_path):
    """checkpoint_frozen=False, one rank, fp64: the checkpoint's model tensors are the head's
    (its parameters x 8 bytes); resumed from step 2 over the base read from pretrained= again, every
    parameter at step 4 is bitwise the run's that did not stop; over another base it is refused,
    naming both."""
    from lightning.pytorch.callbacks import Callback

    base, other, ckpt = tmp_path / "base.pt", tmp_path / "other.pt", str(tmp_path / "head.ckpt")
    torch.save(FrozenBelowTheHead(seed=5).state_dict(), base)
    torch.save(FrozenBelowTheHead(seed=6).state_dict(), other)

    class SaveAt2(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.save_checkpoint(ckpt)

    def run(pretrained: Path, callbacks=(), **resume) -> pl.Trainer:
        strategy = CephaloStrategy(plan=plan_of(batches=[GLOBAL], micro=[2], shares=[1.0]), seed=SEED,
                                   pretrained=pretrained, checkpoint_frozen=False)
        t = helpers.trainer(strategy, 1, 4, precision="64-true", callbacks=list(callbacks))
        t.fit(FrozenBelowTheHead(seed=3), data_loader(True), **resume)  # another init: all from the files
        return t

    uninterrupted = run(base, [SaveAt2()]).strategy.sharded.full_state_dict()
    resumed = run(base, ckpt_path=ckpt).strategy.sharded.full_state_dict()
    assert set(resumed) == set(uninterrupted)
    assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items())
    stored = checkpoint.read_dcp_metadata(Path(ckpt)).state_dict_metadata
    head = FrozenBelowTheHead().model.head.weight.numel()
    assert sum(8 * torch.Size(md.size).numel() for fqn, md in stored.items() if fqn.startswith("model.")) == 8 * head
    with pytest.raises(CheckpointError) as refused:
        run(other, ckpt_path=ckpt)
    assert f"trained over the frozen base {base} " in str(refused.value)
    assert f"read from {other} " in str(refused.value)


def test_a_pretrained_buffer_of_another_shape_is_refused(tmp_path):
    from cephalo_lightning.runtime.sharding.weights import WeightsError, open_weights

    torch.save({"inv_freq": torch.ones(5)}, tmp_path / "weights.pt")
    source = open_weights(tmp_path / "weights.pt")
    assert torch.equal(source.buffer("inv_freq", (5,)), torch.ones(5))
    with pytest.raises(WeightsError, match=r"'inv_freq' has shape \[5\] but the model's 'inv_freq' is \[4\]"):
        source.buffer("inv_freq", (4,))


def test_truncated_or_missing_files_are_clear_errors(tmp_path):
    ckpt = tmp_path / "ckpt"
    _single_rank_checkpoint(ckpt)
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.load_full_state_dict(ckpt)
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=".metadata is missing"):
        checkpoint.load_full_state_dict(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete cephalo checkpoint: manifest.json, which a save writes "
                       "after every other file, is missing. The save was interrupted") as refused:
        checkpoint.load_full_state_dict(ckpt)
    assert "< 0.2" not in str(refused.value)


@pytest.mark.parametrize(("name", "message"), [
    ("lats.ckpt", r"no checkpoint to load: .*lats\.ckpt: no such file or directory \(a typo in the path, or nothing "
                  r"was saved there\); .* holds empty, last\.ckpt\. Check the path, e\.g\. "
                  r"Trainer\.fit\(ckpt_path='checkpoints/last\.ckpt'\)"),
    ("empty", r"no checkpoint to load: .*empty is an empty directory: no checkpoint was ever saved in it"),
])
def test_a_ckpt_path_with_nothing_there_says_so_not_that_a_save_broke(tmp_path, name, message):
    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / "last.ckpt" / "x").write_text("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=message) as refused:
        LOAD_PATHS["Trainer.fit(ckpt_path=dir)"](tmp_path / name)
    assert "interrupted" not in str(refused.value) and "earlier checkpoint" not in str(refused.value)


# ----------------------------------------------------------------------------- kills never leave a fake


@pytest.mark.multiprocess
def test_kills_during_saves_and_deletions_never_leave_a_checkpoint_that_looks_whole(tmp_path):
    """One SIGKILL at every point of a save, of a top-k deletion and of replacing last.ckpt (both
    ways: the atomic exchange and the two-rename fallback), each run resuming from the last one's
    last.ckpt; the points are instrumented calls in the child (see scenarios/kill_points.py), so every
    kill lands where it is meant to, whatever the machine's speed."""
    from scenarios import kill_points

    points = kill_points.points_here(tmp_path)
    seen = kill_points.kill_loop(tmp_path, points)
    saw_complete, interrupted = seen.complete_seen, seen.interrupted
    assert saw_complete >= 10
    # every point but the one before the deletion's rename leaves a leftover behind
    assert interrupted == len(points) - 1, f"only {interrupted} of {len(points)} kills landed inside a save or a deletion"


# ----------------------------------------------------------------------------- single-file export


def test_state_dict_type_full_writes_one_safe_file(tmp_path):
    warnings.simplefilter("ignore")
    t = pl.Trainer(strategy=CephaloStrategy(plan=plan_of(batches=[GLOBAL], micro=[1], shares=[1.0]),
                                            state_dict_type="full"),
                   accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    t.fit(SGDModule(), data_loader(False))
    t.save_checkpoint(tmp_path / "export.ckpt")
    assert (tmp_path / "export.ckpt").is_file() and not list(tmp_path.glob(".*"))
    restored = SGDModule.load_from_checkpoint(tmp_path / "export.ckpt", weights_only=True)
    full = t.strategy.sharded.full_state_dict()
    assert all(torch.equal(restored.state_dict()[k], full[k]) for k in full)


# ----------------------------------------------------------------------------- moving a run off Cephalo


def _plain_resume(path: Path, shuffle: bool, steps: int = TOTAL) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Resume ``path`` under a plain single-process Trainer(strategy="auto"): the weights it starts
    from, the weights it ends with, and its final global step."""
    started: dict[str, torch.Tensor] = {}

    class AtStart(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            started.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    t = pl.Trainer(strategy="auto", accelerator="cpu", devices=1, max_steps=steps, precision="64-true", logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[AtStart()])
    # another init (all must come from the file), in fp64 already: Lightning restores weights before the
    # precision plugin converts the module, so an fp32 module would round the file's fp64 weights
    t.fit(SGDModule(seed=3).double(), data_loader(shuffle), ckpt_path=str(path))
    return started, {k: v.detach() for k, v in t.lightning_module.state_dict().items()}, t.global_step


def _sgd_on(batches: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Single-process SGD on the unshuffled data's batches ``(epoch, index)``, in that order."""
    return sgd_on([torch.arange(at * GLOBAL, (at + 1) * GLOBAL) for _, at in batches])


@pytest.mark.multiprocess
def test_a_consolidated_checkpoint_resumes_under_a_plain_trainer(first_halves, tmp_path):
    warnings.simplefilter("ignore")
    files = {}
    for name in ("ordered/step=5.ckpt", "ordered/step=3.ckpt", "shuffled/step=3.ckpt"):
        files[name] = tmp_path / name.replace("/", "-")
        note = cephalo_lightning.lightning.fit.checkpoint_io.consolidate(first_halves / name, files[name])
        assert "sampler's position (data epoch 0" in note and "Moving a run off Cephalo" in note, note
        assert "combined_loader" not in torch.load(files[name], weights_only=True)["loops"]["fit_loop"]["state_dict"]
    # at an epoch boundary, unshuffled: the plain Trainer continues on the uninterrupted run's batches
    started, ended, step = _plain_resume(files["ordered/step=5.ckpt"], shuffle=False)
    assert step == TOTAL and max_error(started, reference(5, False)) <= 1e-7
    assert max_error(ended, reference(TOTAL, False)) <= 1e-7  # the uninterrupted single-process run
    # mid-epoch: weights and step counters carry over; Lightning restarts the epoch's data (README)
    started, ended, step = _plain_resume(files["ordered/step=3.ckpt"], shuffle=False)
    assert step == TOTAL and max_error(started, reference(3, False)) <= 1e-7
    restarted = [(0, 0), (0, 1), (0, 2), (0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert max_error(ended, _sgd_on(restarted)) <= 1e-7
    started, _, step = _plain_resume(files["shuffled/step=3.ckpt"], shuffle=True)
    assert step == TOTAL and max_error(started, reference(3, True)) <= 1e-7
    # and Cephalo itself, resuming from the consolidated file, continues on its own samples
    t = sgd_trainer(plan_of(batches=[GLOBAL], micro=[2], shares=[1.0]), 1, TOTAL)
    t.fit(SGDModule(seed=3), data_loader(True), ckpt_path=str(files["shuffled/step=3.ckpt"]))
    assert t.global_step == TOTAL and max_error(t.strategy.sharded.full_state_dict(), reference(TOTAL, True)) <= 1e-7
