"""The package as users install it: a wheel in a fresh venv without extras, run from outside the repository.

The venv gets only the wheel and the closure of its CORE dependencies (``[project] dependencies``
and what they require, as pip would install them): each of those distributions is linked in from
this environment (no network, seconds), and nothing else is, so the extras (wandb, safetensors,
transformers, litgpt, matplotlib) are absent there as after a plain ``pip install cephalo-lightning``.
``PYTHONPATH`` is dropped, so every import resolves to the installed copy. One more venv gets the
``[hf,wandb]`` extras and runs the fine-tuning recipe and its CLI config end to end. Also: the configs
shipped in the package are the top-level ``configs/`` files, byte for byte.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from cephalo_lightning import configs
from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "cephalo_lightning")
EXTRAS_MODULES = ("wandb", "safetensors", "transformers", "litgpt", "matplotlib")


def core_distributions(wheel: Path, extras: tuple[str, ...] = ()) -> list[importlib.metadata.Distribution]:
    """The distributions a fresh venv and a plain ``pip install`` of ``wheel`` (with ``extras``) hold: pip,
    the wheel's requirements (those of ``extras`` too) and, recursively, theirs (markers evaluated,
    requested extras followed), found in this environment."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        listed = [Requirement(r) for r in Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist", [])]
    wanted = [Requirement(str(r).split(";")[0]) for r in listed
              if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *extras))]
    found: dict[tuple[str, frozenset[str]], importlib.metadata.Distribution] = {}
    while wanted:
        req = wanted.pop()
        key = (req.name.lower().replace("_", "-"), frozenset(req.extras))
        if key in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        found[key] = dist = importlib.metadata.distribution(req.name)
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (*req.extras, "")):
                wanted.append(Requirement(str(sub).split(";")[0]))
    found[("pip", frozenset())] = importlib.metadata.distribution("pip")  # a fresh venv has pip
    return list({d.metadata["Name"]: d for d in found.values()}.values())


def link_core_site(wheel: Path, target: Path, extras: tuple[str, ...] = ()) -> int:
    """Link every top-level file and folder the wheel's core distributions (and those of ``extras``)
    installed into ``target``; their count."""
    target.mkdir()
    count = 0
    for dist in core_distributions(wheel, extras):
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (target / top).exists():
                (target / top).symlink_to(source)
                count += 1
    return count


def test_the_packaged_configs_are_the_top_level_ones():
    assert "quickstart" in configs.names()
    for packaged in sorted(configs.HERE.glob("*.yaml")):
        top = ROOT / "configs" / packaged.name
        assert top.is_file(), f"{packaged} has no top-level counterpart {top}"
        assert packaged.read_bytes() == top.read_bytes(), (
            f"{packaged.relative_to(ROOT)} differs from {top.relative_to(ROOT)}; the top-level file is the one "
            f"to edit: copy it over the packaged one (cp {top.relative_to(ROOT)} {packaged.relative_to(ROOT)})"
        )


def _run(args: list[str | Path], cwd: Path, env: dict[str, str], timeout: int = HANG_TIMEOUT_S) -> str:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert result.returncode == 0, failure_report(result, tail=5000)
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, freshly built from a copy of the sources (so the build leaves no build/ or egg-info in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in clean_env().items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    build = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                  tmp / "dist", src], cwd=tmp, env=env)
    license_warnings = [line for line in build.splitlines() if "license" in line.lower() and "deprecat" in line.lower()]
    assert not license_warnings, license_warnings  # the metadata is in the current (PEP 639) form
    (built,) = (tmp / "dist").glob("cephalo_lightning-*.whl")
    return built


@pytest.mark.multiprocess
def test_the_wheel_is_the_release_the_changelog_describes(wheel):
    """Its version is pyproject's, the CHANGELOG has that version's section, and its long description is the
    README as Markdown (what the package index shows)."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    assert metadata["Version"] == version and wheel.name.startswith(f"cephalo_lightning-{version}-")
    assert f"## [{version}] - " in (ROOT / "CHANGELOG.md").read_text(), f"CHANGELOG.md has no [{version}] section"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == (ROOT / "README.md").read_text().strip()


def install(wheel: Path, tmp_path_factory, extras: tuple[str, ...] = ()) -> tuple[Path, Path, dict[str, str]]:
    """A fresh venv holding ``wheel`` and the closure of its dependencies (and of ``extras``');
    returns (its bin dir, a cwd outside the repo, env)."""
    tmp = tmp_path_factory.mktemp("venv")
    # no OMP_NUM_THREADS (the suite's one thread per process, tests/conftest.py): as a user's shell has
    # it, so the launcher picks each CPU rank's threads itself
    env = {k: v for k, v in clean_env().items() if k not in ("PYTHONPATH", "PYTHONHOME", "OMP_NUM_THREADS")}
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp,
                        env=env).strip())
    assert link_core_site(wheel, tmp / "core-site", extras) > 0
    # appended after the venv's own site-packages: the wheel's copy wins
    (purelib / "_core_dependencies.pth").write_text(f"{tmp / 'core-site'}\n")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel], cwd=tmp, env=env)  # the wheel alone
    outside = tmp / "elsewhere"
    outside.mkdir()
    where = _run([python, "-c", "import cephalo_lightning; print(cephalo_lightning.__file__)"], cwd=outside, env=env)
    assert Path(where.strip()).is_relative_to(venv), where
    return venv / "bin", outside, env


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv holding only the freshly built wheel (no extras); returns (its bin dir, a cwd
    outside the repo, env)."""
    bin_dir, outside, env = install(wheel, tmp_path_factory)
    python = bin_dir / "python"
    missing = _run([python, "-c", f"import importlib.util as u; print([m for m in {EXTRAS_MODULES!r} if u.find_spec(m)])"],
                   cwd=outside, env=env)
    assert missing.strip() == "[]", f"the venv has extras: {missing}"
    return bin_dir, outside, env


@pytest.mark.multiprocess
def test_installed_demo_prints_its_help_outside_the_repository(installed):
    bin_dir, outside, env = installed
    out = _run([bin_dir / "python", "-m", "cephalo_lightning", "demo", "--help"], cwd=outside, env=env)
    assert "--even-steps" in out and "packaged config" in out


@pytest.mark.multiprocess
def test_installed_cephalo_train_fits_the_packaged_quickstart(installed):
    bin_dir, outside, env = installed
    out = _run([bin_dir / "cephalo-train", "fit", "--config", "quickstart", "--vars.steps=2", "--vars.profile_k=2",
                "--vars.out=run", "--trainer.enable_progress_bar=false"],
               cwd=outside, env=env, timeout=HANG_TIMEOUT_S)
    assert "Cephalo summary" in out and "2 steps" in out, out[-3000:]
    assert (outside / "run" / "checkpoints" / "last.ckpt").is_dir()
    assert (outside / "run" / "plan.json").is_file()
    assert list((outside / "run").glob("*/version_*/metrics.csv"))  # the config's WandbLogger, as CSV (no wandb)


@pytest.mark.multiprocess
def test_installed_demo_runs_to_the_end_without_extras(installed):
    bin_dir, outside, env = installed
    env = {k: v for k, v in env.items() if k != "WANDB_MODE"}  # as a user's shell has it
    out = _run([bin_dir / "python", "-m", "cephalo_lightning", "demo", "--even-steps=1", "--vars.steps=2",
                "--vars.profile_k=2", "--vars.out=demo", "--trainer.enable_progress_bar=false"], cwd=outside, env=env)
    assert "Cephalo demo: done" in out and "speed-up:" in out and "metrics.csv (for W&B" in out, out[-3000:]
    assert 'wandb is not installed' in out and 'pip install "cephalo-lightning[wandb]"' in out, out[-3000:]
    assert (outside / "demo" / "checkpoints" / "last.ckpt").is_dir()
    assert list((outside / "demo").glob("*/version_*/metrics.csv")), sorted(p.name for p in (outside / "demo").iterdir())


@pytest.mark.multiprocess
def test_installed_hf_extra_runs_the_finetune_recipe_and_its_cli_config(wheel, tmp_path_factory):
    """``pip install "cephalo-lightning[hf,wandb,qlora]"`` in a fresh venv, outside the repository:
    examples/finetune_hf.py end to end on 2 emulated ranks (a local pretrained directory, tokenised local
    text, peft LoRA over a 4-bit NF4 base (``--quantize nf4``), bf16-mixed, W&B offline, a checkpoint, adapters and merged model exported,
    generate()), then configs/finetune-lora.yaml through the CLI on the pretrained directory and text it
    wrote. The merged model is read back here, with this environment's transformers."""
    transformers = pytest.importorskip("transformers")

    bin_dir, outside, env = install(wheel, tmp_path_factory, ("hf", "wandb", "qlora"))
    env = {**env, "WANDB_MODE": "offline"}
    for source in ("examples/finetune_hf.py", "configs/finetune-lora.yaml"):
        (outside / source).parent.mkdir(exist_ok=True)
        shutil.copy2(ROOT / source, outside / source)
    out = outside / "ft"
    printed = _run([bin_dir / "python", outside / "examples" / "finetune_hf.py", "--out", out, "--steps", "2",
                    "--quantize", "nf4"], cwd=outside, env=env)
    assert "same tokens" in printed and "4-bit" in printed, printed[-3000:]
    assert sorted(p.name for p in (out / "adapters").iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    assert (out / "checkpoints" / "last.ckpt").is_dir() and any((out / "wandb").glob("offline-run-*"))
    cli = outside / "cli"
    _run([bin_dir / "python", "-m", "cephalo_lightning", "fit", "--config", outside / "configs" / "finetune-lora.yaml",
          f"--vars.base={out / 'base'}", f"--vars.text={out / 'text'}", f"--vars.out={cli}", "--vars.steps=2"],
         cwd=outside, env=env)
    assert (cli / "checkpoints" / "last.ckpt").is_dir()
