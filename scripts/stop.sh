#!/usr/bin/env bash
# Stop the Ray node(s) that scripts/ray_head.sh or scripts/ray_worker.sh started on this machine,
# and wait until none of their processes is left.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/stop.sh [--temp-dir DIR] [--timeout SECONDS]

Stops the Ray processes started by scripts/ray_head.sh / scripts/ray_worker.sh with the same
--temp-dir (default: $MEGARL_RAY_TEMP_DIR, else /tmp/ray), then waits until none is left:
SIGTERM first, SIGKILL for what is still alive after --timeout seconds (default 5).
Exits 1 if a process survives SIGKILL.

Why not `ray stop`: it kills every Ray process of every user's cluster on the machine. The start
scripts mark `ray start` with MEGARL_RAY_NODE_TEMP_DIR=<temp dir> in its environment (inherited by
the GCS, raylet, dashboard, workers and job drivers); only processes with that mark are stopped.

Options:
  --temp-dir DIR     the --temp-dir the node was started with
  --timeout SECONDS  how long to wait for a clean exit before SIGKILL (default 5)
  -h, --help         show this help
USAGE
}

temp_dir="${MEGARL_RAY_TEMP_DIR:-/tmp/ray}"
timeout_s=5
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --temp-dir) temp_dir="${2:?--temp-dir needs a directory}"; shift 2 ;;
    --timeout) timeout_s="${2:?--timeout needs seconds}"; shift 2 ;;
    *) echo "stop.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$timeout_s" in
  ''|*[!0-9]*) echo "stop.sh: --timeout must be a whole number of seconds, got '$timeout_s'" >&2; exit 2 ;;
esac

# Set by the start scripts on `ray start` only, so a user's shell never carries it.
marker="MEGARL_RAY_NODE_TEMP_DIR=$temp_dir"

# PIDs of live processes whose environment holds the marker (unreadable environments are skipped).
marked_pids() {
  local file
  { grep -lzxF -- "$marker" /proc/[0-9]*/environ || true; } 2>/dev/null | while read -r file; do
    file="${file#/proc/}"
    echo "${file%/environ}"
  done
}

# Poll until no marked process is left or the deadline passes; returns 1 on timeout.
wait_until_gone() {
  local deadline=$((SECONDS + $1))
  while [ -n "$(marked_pids)" ]; do
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.5
  done
}

mapfile -t pids < <(marked_pids)
if [ "${#pids[@]}" -eq 0 ]; then
  echo "stop.sh: no Ray process started with --temp-dir $temp_dir is running."
  exit 0
fi
echo "stop.sh: stopping ${#pids[@]} Ray process(es) of --temp-dir $temp_dir"
kill -TERM "${pids[@]}" 2>/dev/null || true
if ! wait_until_gone "$timeout_s"; then
  mapfile -t pids < <(marked_pids)
  echo "stop.sh: ${#pids[@]} process(es) still alive after ${timeout_s}s; sending SIGKILL: ${pids[*]}" >&2
  kill -KILL "${pids[@]}" 2>/dev/null || true
  if ! wait_until_gone 10; then
    echo "stop.sh: ERROR: still running after SIGKILL: $(marked_pids | tr '\n' ' ')" >&2
    exit 1
  fi
fi
echo "stop.sh: done; no Ray process of --temp-dir $temp_dir is left."
