#!/usr/bin/env bash
# TRL in its own venv for benchmarks/vs_trl.py only: .trl-venv reuses this project's .venv packages (torch,
# transformers, datasets, accelerate) through a .pth file and adds TRL, so the two trainers run on the same
# torch and transformers; the project itself never imports TRL.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run setup.sh first" >&2; exit 1; }
python=$(.venv/bin/python -c "import sys; print(sys.executable)")
site=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
"$python" -m venv --without-pip .trl-venv 2>/dev/null || "$python" -m venv .trl-venv
trl_site=$(.trl-venv/bin/python -c "import site; print(site.getsitepackages()[0])")
printf '%s\n%s\nimport plumbing.cpu_stack; plumbing.cpu_stack.install()\n' "$site" "$PWD" > "$trl_site/project-venv.pth"
.venv/bin/python -m pip install --quiet --no-deps --target "$trl_site" trl==1.16.0
.trl-venv/bin/python -c "import trl; print('TRL', trl.__version__, 'in .trl-venv')"
