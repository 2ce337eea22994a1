#!/usr/bin/env bash
# Create .venv and install the pinned dependencies, once. torch comes first so nothing else can
# pull a default (CUDA, several GB) build onto a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP=.venv/.installed-$(cat requirements.txt scripts/setup.sh | cksum | cut -d' ' -f1)
[ -f "$STAMP" ] && exit 0
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip install --quiet --disable-pip-version-check"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    $PIP torch==2.13.0                                   # CUDA build, for nccl on GPUs
else
    # CPU build: from a local wheel or index if this machine has one, else PyTorch's CPU index
    $PIP "torch==2.13.0+cpu" 2>/dev/null \
        || $PIP torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
$PIP -r requirements.txt
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
rm -f .venv/.installed-*
touch "$STAMP"
