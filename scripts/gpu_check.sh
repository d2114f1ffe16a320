#!/usr/bin/env bash
# Run the GPU suite (tests/gpu) and write one JSON report: device, versions, per-test results and
# memory high-water marks per phase. Without a GPU every test is skipped and the report says so.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/gpu_check.sh [--python PY] [--report PATH] [-- PYTEST_ARGS...]

Runs tests/gpu (megarl's end-to-end paths on CUDA: bf16 actor with the Transformer Engine spec,
vLLM sleep/wake/reload, the NCCL weight sync, the CUDA IPC ring, a short GRPO run) and writes one JSON report: the
device, the versions of the stack, each test's outcome and duration, and memory high-water marks
per phase. On a machine without a GPU every test is skipped, the report says so, and the exit
code is 0. The exit code is pytest's otherwise (0: all passed or skipped).

The Python must have megarl installed with the CUDA stack: inside the CUDA image (docker/Dockerfile),
or an environment made with `pip install -e '.[gpu,dev]'` on top of a CUDA torch. This script
installs nothing.

Options:
  --python PY    interpreter to run with (default: $MEGARL_PYTHON, else .venv/bin/python when it
                 exists, else python3)
  --report PATH  where the JSON report goes (default: benchmarks/results/gpu_check.json)
  -h, --help     show this help
USAGE
}

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${MEGARL_PYTHON:-}"
report="$root/benchmarks/results/gpu_check.json"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python) [ $# -ge 2 ] || { echo "gpu_check.sh: --python needs a value" >&2; exit 2; }; python_bin="$2"; shift 2 ;;
    --report) [ $# -ge 2 ] || { echo "gpu_check.sh: --report needs a value" >&2; exit 2; }; report="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$python_bin" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python_bin="$root/.venv/bin/python"; else python_bin=python3; fi
fi
command -v "$python_bin" >/dev/null 2>&1 || { echo "gpu_check.sh: ERROR: no interpreter '$python_bin' (use --python)" >&2; exit 2; }
"$python_bin" -c 'import megarl, torch, pytest' 2>/dev/null || {
  echo "gpu_check.sh: ERROR: $python_bin cannot import megarl, torch and pytest; install megarl with" \
       "pip install -e '.[gpu,dev]' (or run inside the CUDA image), or point --python at such an interpreter" >&2
  exit 2
}
case "$report" in /*) ;; *) report="$PWD/$report" ;; esac

cd "$root"
echo "gpu_check.sh: running tests/gpu with $python_bin; report: $report"
status=0
MEGARL_GPU_REPORT="$report" "$python_bin" -m pytest -p no:cacheprovider -rs tests/gpu "$@" || status=$?
[ -f "$report" ] || { echo "gpu_check.sh: ERROR: pytest wrote no report to $report" >&2; exit 1; }
"$python_bin" - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
device = report["device"]
where = f"{device['count']} x {device['name']}" if device["cuda_available"] else "no CUDA device"
print(f"gpu_check.sh: {where}; " + ", ".join(f"{n} {k}" for k, n in report["summary"].items()))
PY
exit "$status"
