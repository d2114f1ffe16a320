#!/usr/bin/env bash
# Set up .venv, make a tiny model and the quickstart data, and train it with GRPO on CPU
# (megatron-core actor with TP 2 on gloo, vLLM rollout, the real weight-sync bridge, Ray).
# Extra arguments are config overrides, e.g. `bash scripts/quickstart.sh trainer.total_steps=20`.
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "Usage: bash scripts/quickstart.sh [--moe] [key=value ...]"
  echo "Trains a tiny model with GRPO on CPU (configs/quickstart.yaml) and prints where the metrics and plot are."
  echo "--moe: a tiny mixture of experts instead, its experts split over the two processes, with rollout routing"
  echo "       replay (configs/quickstart_moe.yaml)."
  exit 0
fi
arch=qwen2 model=outputs/tiny-model recipe=configs/quickstart.yaml
if [ "${1:-}" = "--moe" ]; then
  shift
  arch=qwen3_moe model=outputs/tiny-moe-model recipe=configs/quickstart_moe.yaml
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
megarl=("$root/.venv/bin/megarl")

if [ ! -f "$model/config.json" ]; then
  echo "quickstart: making a tiny $arch model in $model"
  "${megarl[@]}" init-tiny-model --out "$model" --arch "$arch"
fi
if [ ! -f outputs/quickstart-data/train.jsonl ]; then
  echo "quickstart: writing the task data to outputs/quickstart-data"
  "${megarl[@]}" make-data --task repeat_first_char --out outputs/quickstart-data
fi
echo "quickstart: training ($recipe)"
# A fresh run each time (a rerun would otherwise resume the finished one and train nothing).
"${megarl[@]}" train "$recipe" checkpoint.resume=disable "$@"
