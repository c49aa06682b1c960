"""``import cephalo_lightning`` registers ``strategy="cephalo"`` lazily, and the planner stays torch-free.

Each check runs in a fresh interpreter: what is imported, and in which order, is the point.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report

ROOT = Path(__file__).resolve().parents[2]

HEAVY = "assert not {'torch', 'lightning'} & set(sys.modules), sorted({'torch', 'lightning'} & set(sys.modules))"
TRAINER = ("t = pl.Trainer(strategy='cephalo', accelerator='cpu', devices=1, logger=False, "
           "enable_progress_bar=False, enable_model_summary=False); "
           "assert type(t.strategy).__name__ == 'CephaloStrategy', type(t.strategy)")
FABRIC = ("import lightning.fabric as lf; f = lf.Fabric(strategy='cephalo', accelerator='cpu', devices=1); "
          "assert type(f.strategy).__name__ == 'CephaloFabricStrategy', type(f.strategy)")


def _python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=clean_env(),
                            timeout=HANG_TIMEOUT_S)
    assert result.returncode == 0, failure_report(result)
    return result


@pytest.mark.multiprocess
def test_the_package_and_the_planner_import_without_torch_or_lightning(tmp_path):
    _python(f"import cephalo_lightning.planner, sys; {HEAVY}", cwd=tmp_path)
    _python(f"import cephalo_lightning, sys; {HEAVY}; assert 'CephaloStrategy' in dir(cephalo_lightning)", cwd=tmp_path)


@pytest.mark.multiprocess
def test_the_plan_command_imports_neither_torch_nor_lightning(tmp_path):
    cluster = ROOT / "configs" / "clusters" / "t4-example.yaml"
    code = ("import sys; from cephalo_lightning.__main__ import main; "
            f"assert main(['plan', {str(cluster)!r}, '--global-batch-size', '16']) == 0; {HEAVY}")
    assert "samples/s" in _python(code, cwd=tmp_path).stdout


@pytest.mark.multiprocess
def test_strategy_name_works_with_lightning_imported_first():
    """The Trainer's and Fabric's ``strategy="cephalo"``, the package imported after Lightning (the other
    order: :func:`test_lightning_keeps_its_own_loader_and_a_reload_registers_again`)."""
    _python(f"import lightning; import cephalo_lightning; import lightning.pytorch as pl; {TRAINER}; {FABRIC}")


@pytest.mark.multiprocess
def test_strategy_name_without_the_import_is_lightnings_invalid_name():
    """Without importing the package, Lightning does not know the name (importing it is the fix: above)."""
    code = f"import lightning.pytorch as pl; {TRAINER}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                            timeout=HANG_TIMEOUT_S)
    assert result.returncode != 0 and "invalid strategy name" in result.stderr, failure_report(result)


@pytest.mark.multiprocess
def test_lightning_keeps_its_own_loader_and_a_reload_registers_again():
    """The package imported first: Lightning's strategies module keeps its loader, the name is registered
    before the strategy's module is imported, a reload registers it again, and the Trainer's and
    Fabric's ``strategy="cephalo"`` work."""
    code = (
        "import importlib, importlib.machinery, sys, cephalo_lightning, lightning.pytorch as pl; "
        "import lightning.pytorch.strategies as s; "
        "assert type(s.__loader__) is importlib.machinery.SourceFileLoader, s.__loader__; "
        "assert s.__spec__.loader is s.__loader__; "
        "assert 'cephalo_lightning.lightning.strategy.cephalo_strategy' not in sys.modules; "  # registered, not yet imported
        "assert 'ddp' in s.StrategyRegistry and 'cephalo' in s.StrategyRegistry; "
        "importlib.reload(s); assert 'cephalo' in s.StrategyRegistry; "
        f"{TRAINER}; {FABRIC}"
    )
    _python(code)
