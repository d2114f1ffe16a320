#!/usr/bin/env bash
# Multi-turn GRPO with a tool on CPU: a tiny model with tool tokens, a short SFT warm-up on demonstrations
# of the built-in calculator (megarl sft), then GRPO where each sample may call the calculator
# (configs/agent_quickstart.yaml). The reward and the tool-call rate rise; curves.png shows both, and
# rollouts.jsonl one whole trajectory per step. Extra arguments are overrides of the GRPO recipe.
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "Usage: bash scripts/agent_quickstart.sh [key=value ...]"
  echo "Warms up a tiny model on calculator demonstrations (megarl sft), then trains it with multi-turn GRPO"
  echo "and the calculator tool on CPU (configs/agent_quickstart.yaml); prints where the metrics and plot are."
  exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
megarl=("$root/.venv/bin/megarl")

if [ ! -f outputs/agent/tiny-model/config.json ]; then
  echo "agent quickstart: making a tiny Qwen2 model with tool tokens in outputs/agent/tiny-model"
  "${megarl[@]}" init-tiny-model --tool-tokens --out outputs/agent/tiny-model --arch qwen2
fi
if [ ! -f outputs/agent/sft-data/train.jsonl ]; then
  echo "agent quickstart: writing calculator demonstrations to outputs/agent/sft-data"
  "${megarl[@]}" make-data --task calc_tool_demos --out outputs/agent/sft-data --n-train 2048 --n-val 16
fi
if [ ! -f outputs/agent/data/train.jsonl ]; then
  echo "agent quickstart: writing the task's prompts to outputs/agent/data"
  "${megarl[@]}" make-data --task calc --out outputs/agent/data
fi
if [ ! -f outputs/agent/sft-model/config.json ]; then
  echo "agent quickstart: warm-up (configs/sft_agent.yaml)"
  "${megarl[@]}" sft configs/sft_agent.yaml
fi
echo "agent quickstart: multi-turn GRPO with the calculator (configs/agent_quickstart.yaml)"
"${megarl[@]}" train configs/agent_quickstart.yaml checkpoint.resume=disable "$@"
