"""The package, its compiled extension and the CLI."""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from elasticlab import _ext
from elasticlab.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_extension_is_built_and_registers_cpu_kernels():
    assert _ext.HAS_C, "elasticlab._C failed to import: run `make build`"
    assert "row_sq_norms" in _ext.operators()
    assert _ext.has_kernel("row_sq_norms", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_sq_norms_matches_torch(dtype):
    x = torch.randn(5, 3, 4, dtype=dtype)
    got = torch.ops.elasticlab.row_sq_norms(x)
    torch.testing.assert_close(got, x.pow(2).sum((1, 2)))


def test_operator_rejects_integer_input_with_clear_error():
    with pytest.raises(RuntimeError, match="expected a floating tensor"):
        torch.ops.elasticlab.row_sq_norms(torch.ones(3, 2, dtype=torch.int64))


@pytest.mark.gpu
def test_row_sq_norms_cuda_matches_cpu():
    assert _ext.has_kernel("row_sq_norms", "cuda")
    x = torch.randn(64, 1000, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.elasticlab.row_sq_norms(x.cuda()).cpu(),
                               torch.ops.elasticlab.row_sq_norms(x))


def test_missing_extension_warns_once(monkeypatch):
    monkeypatch.setattr(_ext, "HAS_C", False)
    monkeypatch.setattr(_ext, "_warned", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert _ext.kernel("row_sq_norms", "cpu") is None
        assert _ext.kernel("row_sq_norms", "cpu") is None
    assert len([w for w in rec if "reference path" in str(w.message)]) == 1


def test_info_command(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "extension_built        True" in out
    assert "row_sq_norms" in out


def test_console_script_equals_module():
    out = subprocess.run([sys.executable, "-m", "elasticlab", "info"], capture_output=True, text=True,
                         check=True)
    assert "torch" in out.stdout


def test_ruff_clean():
    """The tree passes the ruff settings of pyproject.toml (ruff comes with the test extra)."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed")
    out = subprocess.run([ruff, "check", "--quiet", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
