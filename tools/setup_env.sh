#!/usr/bin/env bash
# Create ./.venv (if missing) and install dattri-ds with everything the demo and tests need.
# torch is installed FIRST from the pinned CPU wheel: anything that pulls plain `torch`
# first would download a multi-GB CUDA build. Set DATTRI_DS_TORCH to choose another torch
# (e.g. "torch==2.13.0" on a CUDA machine with a matching index).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DATTRI_DS_VENV:-.venv}"
TORCH_SPEC="${DATTRI_DS_TORCH:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.dattri_ds_installed"
want="$(cat setup.py | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# pip's "WARNING: Location" lines are noise; the filter must not hide pip's exit status:
# with pipefail a failed install fails set-up, and `quiet` itself succeeds on empty output.
quiet() { grep -v "^WARNING: Location" || true; }
"$PY" -m pip install -q --upgrade pip 2>&1 | quiet
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "$TORCH_SPEC" 2>&1 | quiet
fi
"$PY" -m pip install -q -e ".[hf,deepspeed,megatron,plot,test]" 2>&1 | quiet
# Every extra the tests use must import, or set-up fails here (not as skipped tests later).
"$PY" -c "import torch, dattri_ds, transformers, deepspeed, megatron.core, sentencepiece; \
print('dattri-ds env ready: torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
echo "$want" > "$stamp"
