"""The package as users install it: a wheel in a fresh venv, run from outside the repository.

The venv reuses this environment's dependencies through a ``.pth`` line (no network, seconds),
and only the wheel itself is installed into it; ``PYTHONPATH`` is dropped, so every import
resolves to the installed copy. Also: the configs shipped in the package are the top-level
``configs/`` files, byte for byte.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from cephalo_lightning import configs
from tests.conftest import HANG_TIMEOUT_S, clean_env

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "cephalo_lightning")


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
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv holding only the freshly built wheel; returns (its bin dir, a cwd outside the repo, env)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
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
    (wheel,) = (tmp / "dist").glob("cephalo_lightning-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp,
                        env=env).strip())
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    # appended after the venv's own site-packages: the wheel's copy wins over any editable install
    (purelib / "_reuse_dependencies.pth").write_text("\n".join(sorted(p for p in ours if os.path.isdir(p))) + "\n")
    # --force-reinstall: the reused environment may list an (editable) cephalo-lightning already
    _run([python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index", wheel], cwd=tmp, env=env)
    outside = tmp / "elsewhere"
    outside.mkdir()
    where = _run([python, "-c", "import cephalo_lightning; print(cephalo_lightning.__file__)"], cwd=outside, env=env)
    assert Path(where.strip()).is_relative_to(venv), where
    return venv / "bin", outside, env


@pytest.mark.multiprocess
def test_installed_demo_prints_its_help_outside_the_repository(installed):
    bin_dir, outside, env = installed
    out = _run([bin_dir / "python", "-m", "cephalo_lightning", "demo", "--help"], cwd=outside, env=env)
    assert "--even-steps" in out and "packaged config" in out


@pytest.mark.multiprocess
def test_installed_cephalo_train_fits_the_packaged_quickstart(installed):
    bin_dir, outside, env = installed
    out = _run([bin_dir / "cephalo-train", "fit", "--config", "quickstart", "--vars.steps=2", "--vars.profile_k=2",
                "--vars.out=run", "--trainer.logger=false", "--trainer.enable_progress_bar=false"],
               cwd=outside, env=env, timeout=HANG_TIMEOUT_S)
    assert "Cephalo summary" in out and "2 steps" in out, out[-3000:]
    assert (outside / "run" / "checkpoints" / "last.ckpt").is_dir()
    assert (outside / "run" / "plan.json").is_file()
