#!/usr/bin/env bash
# Check a GPU machine: the driver against the CUDA 13 floor, the GPU suite (tests/gpu, one JSON report),
# an NCCL all-reduce probe and short quickstart runs on cuda. Without a GPU every test is skipped and the
# report says so. See --help.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/gpu_check.sh [--python PY] [--report PATH] [--work DIR] [-- PYTEST_ARGS...]

Checks a GPU machine for megarl, in this order, each step bounded in time:
  1. the NVIDIA driver (nvidia-smi) against the floor of the CUDA 13 stack (megarl/versions.py
     CUDA_DRIVER_MIN, R580+); below it the script stops with exit code 3
  2. tests/gpu (megarl's end-to-end paths on CUDA: bf16 actor with the Transformer Engine spec,
     vLLM sleep/wake/reload, the NCCL weight sync, the CUDA IPC ring, a short GRPO run), writing one
     JSON report: the device, the versions of the stack, each test's outcome and duration, and memory
     high-water marks per phase
  3. an NCCL all-reduce over all local GPUs (scripts/nccl_probe.py): its bandwidth in GB/s and the
     network transport NCCL picked (NET/IB = InfiniBand/RoCE, NET/Socket = TCP), from NCCL_DEBUG=INFO
  4. the fp32 quickstart (configs/quickstart.yaml) on cuda, 2 steps, actor TP 1 on one GPU
  5. with 2 or more GPUs: the same run with actor TP 2 and rollout TP 2, colocated on 2 GPUs
Steps 3-5 write their logs, the tiny model and data under --work. On a machine without an NVIDIA driver the driver
check and steps 3-5 are skipped, every test of step 2 is skipped, the report says so, and the exit
code is 0. Otherwise the exit code is 1 when any step failed (each failure is named at the end),
0 when all passed.

The Python must have megarl installed with the CUDA stack and pytest (the gpu and dev extras, installed
as docker/README.md says); the CUDA image (docker/Dockerfile) holds neither pytest nor tests/. This
script installs nothing.

Options:
  --python PY    interpreter to run with (default: $MEGARL_PYTHON, else .venv/bin/python when it
                 exists, else python3)
  --report PATH  where the JSON report goes (default: benchmarks/results/gpu_check.json)
  --work DIR     scratch directory of steps 3-5 (default: outputs/gpu_check)
  -h, --help     show this help
USAGE
}

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${MEGARL_PYTHON:-}"
report="$root/benchmarks/results/gpu_check.json"
work="$root/outputs/gpu_check"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python) [ $# -ge 2 ] || { echo "gpu_check.sh: --python needs a value" >&2; exit 2; }; python_bin="$2"; shift 2 ;;
    --report) [ $# -ge 2 ] || { echo "gpu_check.sh: --report needs a value" >&2; exit 2; }; report="$2"; shift 2 ;;
    --work) [ $# -ge 2 ] || { echo "gpu_check.sh: --work needs a value" >&2; exit 2; }; work="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$python_bin" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python_bin="$root/.venv/bin/python"; else python_bin=python3; fi
fi
command -v "$python_bin" >/dev/null 2>&1 || { echo "gpu_check.sh: ERROR: no interpreter '$python_bin' (use --python)" >&2; exit 2; }
"$python_bin" -c 'import megarl, torch, pytest' 2>/dev/null || {
  echo "gpu_check.sh: ERROR: $python_bin cannot import megarl, torch and pytest; install megarl with the gpu" \
       "and dev extras as docker/README.md says ('Installing the gpu extra outside the image')," \
       "or point --python at such an interpreter" >&2
  exit 2
}
case "$report" in /*) ;; *) report="$PWD/$report" ;; esac
case "$work" in /*) ;; *) work="$PWD/$work" ;; esac

cd "$root"
mkdir -p "$(dirname "$report")"
mkdir -p "$work"
# only what this script makes there (a --work pointed at a used directory keeps the rest)
rm -rf "$work/tiny-model" "$work/quickstart-data" "$work/quickstart_fp32_cuda" "$work/quickstart_tp2_colocated"
# Bounds per step (seconds): the script runs on short device leases.
probe_timeout=180
train_timeout=420

# 1. Driver. One line per GPU of the machine (nvidia-smi ignores CUDA_VISIBLE_DEVICES).
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  floor="$("$python_bin" -c 'from megarl.versions import CUDA_DRIVER_MIN; print(CUDA_DRIVER_MIN)')"
  drivers="$(timeout 60 nvidia-smi --query-gpu=driver_version --format=csv,noheader)" || {
    echo "gpu_check.sh: ERROR: nvidia-smi --query-gpu=driver_version failed (is the NVIDIA driver loaded?)" >&2; exit 3; }
  gpus="$(printf '%s\n' "$drivers" | grep -c .)" || true
  driver="$(printf '%s\n' "$drivers" | head -n 1 | tr -d ' ')"
  if [ "$(printf '%s\n%s\n' "$floor" "$driver" | sort -V | head -n 1)" != "$floor" ]; then
    echo "gpu_check.sh: ERROR: NVIDIA driver $driver is older than $floor, the floor of megarl's CUDA 13 stack" \
         "(R580+, see docker/README.md, 'NVIDIA driver'); upgrade the host's driver to $floor or newer" >&2
    exit 3
  fi
  echo "gpu_check.sh: NVIDIA driver $driver (floor $floor): OK; $gpus GPU(s)"
else
  echo "gpu_check.sh: no nvidia-smi (no NVIDIA driver): driver check, NCCL probe and CUDA runs skipped"
fi

failed=()
# 2. tests/gpu, with its JSON report.
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
[ "$status" -eq 0 ] || failed+=("tests/gpu (pytest exit $status)")

# 3. NCCL all-reduce over the local GPUs; NCCL's INFO log says which network transport it loaded.
if [ "$gpus" -ge 1 ]; then
  log="$work/nccl_probe.log"
  if NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET timeout "$probe_timeout" \
       "$python_bin" -m torch.distributed.run --standalone --nproc-per-node "$gpus" scripts/nccl_probe.py >"$log" 2>&1; then
    grep -m 1 '^nccl_probe:' "$log" || failed+=("NCCL probe (no result line in $log)")
  else
    echo "gpu_check.sh: ERROR: the NCCL all-reduce probe failed or ran past ${probe_timeout}s; its log: $log" >&2
    tail -n 20 "$log" >&2
    failed+=("NCCL probe")
  fi
  if grep -q 'NET/IB : Using' "$log"; then
    echo "gpu_check.sh: NCCL network: NET/IB (InfiniBand/RoCE): $(grep -m 1 -o 'NET/IB : Using.*' "$log")"
  elif grep -q 'NET/Socket' "$log"; then
    echo "gpu_check.sh: NCCL network: NET/Socket (TCP): no usable InfiniBand device; across nodes NCCL would" \
         "use TCP (see docker/README.md, 'NVIDIA driver', on passing RDMA devices to the container)"
  else
    echo "gpu_check.sh: NCCL network: not reported in $log (NCCL_DEBUG=INFO printed no NET/ line)"
  fi
fi

# 4-5. The fp32 quickstart on cuda, then TP 2 / rollout TP 2 colocated, on a tiny model and data made in
# the scratch directory.
run_quickstart() {  # NAME KEY=VALUE...: 2 steps of configs/quickstart.yaml on cuda
  local name="$1" dir="$work/$1"
  shift
  mkdir -p "$dir"
  if timeout "$train_timeout" "$python_bin" -m megarl.cli.main train configs/quickstart.yaml \
       trainer.device=cuda trainer.total_steps=2 checkpoint.resume=disable \
       model.path="$work/tiny-model" "data.train_files=[$work/quickstart-data/train.jsonl]" \
       "data.val_files=[$work/quickstart-data/val.jsonl]" checkpoint.dir="$dir/checkpoints" \
       trainer.output_dir="$dir/outputs" "$@" >"$dir/train.log" 2>&1; then
    echo "gpu_check.sh: $name: OK ($*)"
  else
    echo "gpu_check.sh: ERROR: $name failed or ran past ${train_timeout}s ($*); its log: $dir/train.log" >&2
    tail -n 20 "$dir/train.log" >&2
    failed+=("$name")
  fi
}
if [ "$gpus" -ge 1 ]; then
  if "$python_bin" -m megarl.cli.main init-tiny-model --out "$work/tiny-model" --arch qwen2 >"$work/prepare.log" 2>&1 \
     && "$python_bin" -m megarl.cli.main make-data --task repeat_first_char --out "$work/quickstart-data" >>"$work/prepare.log" 2>&1; then
    run_quickstart quickstart_fp32_cuda actor.parallel.tensor_model_parallel_size=1 placement.gpus_per_node=1
    if [ "$gpus" -ge 2 ]; then
      run_quickstart quickstart_tp2_colocated actor.parallel.tensor_model_parallel_size=2 \
        rollout.tensor_model_parallel_size=2 placement.gpus_per_node=2
    else
      echo "gpu_check.sh: TP 2 / rollout TP 2 colocated run skipped: 1 GPU"
    fi
  else
    echo "gpu_check.sh: ERROR: making the tiny model and data failed; its log: $work/prepare.log" >&2
    failed+=("quickstart preparation")
  fi
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo "gpu_check.sh: FAILED: $(IFS=';'; echo "${failed[*]}")" >&2
  exit 1
fi
echo "gpu_check.sh: all checks passed"
