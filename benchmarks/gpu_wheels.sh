#!/usr/bin/env bash
# The pure-Python packages grpo.py needs that the lent GPU machine's image lacks (it has torch, transformers,
# peft, pytest, rich, jinja2, pyyaml, pyarrow, pandas, sympy), as Python 3.12 wheels in .whl/ (git-ignored),
# to carry there with the device tool. Versions: those requirements-cpu.txt resolves to here, and the GPU stack's
# flash-linear-attention (pure Triton: gpu_check.py's kernels part measures Gated DeltaNet on it).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
  flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
du -sh .whl
