#!/usr/bin/env bash
# Submit a command as a Ray job, follow its logs, and exit with the job's exit code.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/submit.sh [options] -- COMMAND [ARGS...]

Submits COMMAND as a Ray job with this repository as its working directory, streams the job's
logs until it ends, and exits with the job's own exit code (0 when it succeeded; the entrypoint's
exit code when it failed; 1 when the job was stopped or its code is unknown). Interrupting this
command (Ctrl-C, SIGTERM, scancel) stops the job too.

The uploaded working directory leaves out .git, .venv, outputs/runs/checkpoints, caches, model and
data files (*.safetensors, *.bin, *.pt, ...) and any file over 50 MiB.

Options:
  --wait-nodes N         before submitting, wait until the cluster has N alive nodes (head included)
  --wait-timeout SECONDS how long --wait-nodes waits (default 300)
  --address URL          the head's job API (default: $RAY_API_SERVER_ADDRESS, else http://127.0.0.1:8265)
  --working-dir DIR      directory uploaded as the job's working directory (default: the repo root)
  --submission-id ID     job id (default: megarl-<UTC time>-<random>)
  -h, --help             show this help

Example:  bash scripts/submit.sh -- megarl validate configs/quickstart.yaml
USAGE
}

fail() { echo "submit.sh: ERROR: $*" >&2; exit 1; }
bad_arg() { echo "submit.sh: $*" >&2; exit 2; }

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
address="${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}"
working_dir="$root"
submission_id="megarl-$(date -u +%Y%m%d-%H%M%S)-$RANDOM"
wait_nodes=0
wait_timeout=300
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --address) address="${2:?--address needs a value}"; shift 2 ;;
    --working-dir) working_dir="${2:?--working-dir needs a value}"; shift 2 ;;
    --submission-id) submission_id="${2:?--submission-id needs a value}"; shift 2 ;;
    --wait-nodes) wait_nodes="${2:?--wait-nodes needs a value}"; shift 2 ;;
    --wait-timeout) wait_timeout="${2:?--wait-timeout needs a value}"; shift 2 ;;
    --) shift; break ;;
    *) bad_arg "unknown argument '$1'; put the job's command after '--' (see --help)" ;;
  esac
done
[ $# -gt 0 ] || bad_arg "no command to run: bash scripts/submit.sh [options] -- COMMAND [ARGS...]"
for pair in "wait-nodes=$wait_nodes" "wait-timeout=$wait_timeout"; do
  case "${pair#*=}" in
    ''|*[!0-9]*) bad_arg "--${pair%%=*} must be a whole number, got '${pair#*=}'" ;;
  esac
done
[ -d "$working_dir" ] || bad_arg "--working-dir '$working_dir' is not a directory"
working_dir="$(cd "$working_dir" && pwd)"
command -v ray >/dev/null 2>&1 \
  || fail "'ray' is not on PATH: activate the environment (source .venv/bin/activate) or run inside the megarl image."

# Ray 2.60 `ray start` turns on token authentication when a token exists (RAY_AUTH_TOKEN,
# RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) unless RAY_AUTH_MODE says otherwise, but some CLI clients
# (`ray health-check`) only send the token when RAY_AUTH_MODE=token: make the choice explicit for all.
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
  export RAY_AUTH_MODE=token
fi

# Bounded wait for the whole cluster (a multi-node job placed on a partial cluster would wait or fail).
if [ "$wait_nodes" -gt 0 ]; then
  deadline=$((SECONDS + wait_timeout))
  # `--format json` prints the whole list on one line: count the ids, not the lines.
  until alive="$(ray list nodes --address "$address" --filter state=ALIVE --format json 2>/dev/null \
                 | grep -o '"node_id"' | wc -l)" \
        && [ "$alive" -ge "$wait_nodes" ]; do
    [ "$SECONDS" -lt "$deadline" ] \
      || fail "the cluster at $address did not reach $wait_nodes alive node(s) within ${wait_timeout}s (has ${alive:-none})."
    sleep 2
  done
  echo "submit.sh: $alive node(s) alive."
fi

# gitignore-style patterns, relative to the working directory.
excludes=(.git .venv venv outputs runs checkpoints wandb __pycache__ .pytest_cache "*.egg-info"
          "*.safetensors" "*.bin" "*.pt" "*.pth" "*.ckpt" "*.gguf" "*.tar" "*.tar.gz" "*.zip")
# Ray refuses working directories over its upload limit; large files have no place in one anyway.
while IFS= read -r -d '' big; do
  excludes+=("/${big#./}")
done < <(cd "$working_dir" && find . \( -name .git -o -name .venv -o -name outputs -o -name runs \) -prune \
           -o -type f -size +50M -print0)

json_string() {
  local s="${1//\\/\\\\}"
  s="${s//\"/\\\"}"
  printf '"%s"' "$s"
}
runtime_env="{\"working_dir\": $(json_string "$working_dir"), \"excludes\": ["
for i in "${!excludes[@]}"; do
  [ "$i" -gt 0 ] && runtime_env+=", "
  runtime_env+="$(json_string "${excludes[$i]}")"
done
runtime_env+="]}"

# shellcheck disable=SC2329  # invoked by the trap below
stop_job() {
  echo "submit.sh: interrupted; stopping job $submission_id" >&2
  kill "$submit_pid" 2>/dev/null || true
  ray job stop --address "$address" "$submission_id" >/dev/null 2>&1 || true
  exit 130
}

echo "submit.sh: submitting job $submission_id to $address: $(printf '%q ' "$@")"
# In the background so that a signal to this script runs the trap at once (bash defers traps until a
# foreground child exits, and this one streams logs until the job ends).
ray job submit --address "$address" --submission-id "$submission_id" \
  --runtime-env-json "$runtime_env" -- "$@" &
submit_pid=$!
trap stop_job INT TERM
submit_rc=0
wait "$submit_pid" || submit_rc=$?
trap - INT TERM
[ "$submit_rc" = 0 ] && exit 0

# `ray job submit` only says succeeded (0) or not (1): the job's own exit code comes from Ray's job client
# (JobDetails.driver_exit_code; None when the entrypoint never ran or was stopped), with the Python that runs `ray`.
ray_bin="$(command -v ray)"
ray_python="${ray_bin%/*}/python"
[ -x "$ray_python" ] || ray_python=python3
code="$("$ray_python" - "$address" "$submission_id" <<'PY' 2>&1
import sys

from ray.job_submission import JobSubmissionClient

info = JobSubmissionClient(sys.argv[1]).get_job_info(sys.argv[2])
print("" if info.driver_exit_code is None else info.driver_exit_code)
PY
)" || fail "job $submission_id: submission failed and its status is unavailable (is the head at $address up?):
$code"
echo "submit.sh: job $submission_id did not succeed (exit code ${code:-unknown})." >&2
case "$code" in
  ''|0) exit 1 ;;
  -*) exit $((128 - code)) ;;  # killed by signal N: the shell convention 128 + N
  *) exit "$code" ;;
esac
