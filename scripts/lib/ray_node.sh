#!/usr/bin/env bash
# Shared by scripts/ray_head.sh and scripts/ray_worker.sh (sourced, not run): argument checks, the
# Ray auth mode, the network interface, and `ray start` itself. The caller sets `prog` (its name).

: "${prog:?set prog to the name of the script that sources ray_node.sh}"

fail() { echo "$prog: ERROR: $*" >&2; exit 1; }
bad_arg() { echo "$prog: $*" >&2; exit 2; }

# require_whole_numbers "option=value" ...: exit 2 naming the first option whose value is not a whole number.
require_whole_numbers() {
  local pair
  for pair in "$@"; do
    case "${pair#*=}" in
      ''|*[!0-9]*) bad_arg "--${pair%%=*} must be a whole number, got '${pair#*=}'" ;;
    esac
  done
}

require_ray() {
  command -v ray >/dev/null 2>&1 \
    || fail "'ray' is not on PATH: activate the environment (source .venv/bin/activate) or run inside the megarl image."
  # Ray 2.60 `ray start` turns on token authentication when a token exists (RAY_AUTH_TOKEN,
  # RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) unless RAY_AUTH_MODE says otherwise, but some CLI clients
  # (`ray health-check`) only send the token when RAY_AUTH_MODE=token: make the choice explicit for all.
  if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
    export RAY_AUTH_MODE=token
  fi
}

# use_iface IFNAME: set iface_ip to the interface's IPv4 address (the node IP) and make NCCL and Gloo
# use the interface. Not in a subshell: the exports must reach `ray start`.
use_iface() {
  iface_ip="$(ip -4 -o addr show dev "$1" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')"
  [ -n "$iface_ip" ] || fail "--iface $1: no IPv4 address on that interface (see \`ip -4 addr\`)."
  # Inherited by every Ray process on this node, so NCCL/Gloo in the workers use the same network.
  export NCCL_SOCKET_IFNAME="$1" GLOO_SOCKET_IFNAME="$1"
}

# start_ray_node BLOCK TEMP_DIR LOG_COPY_DIR ARGS...: `ray start ARGS` with the node's processes marked for
# scripts/stop.sh; BLOCK=1 runs `ray start --block` in the foreground (containers, Slurm) until Ray ends or this
# script gets SIGTERM/SIGINT, then copies Ray's logs to LOG_COPY_DIR/<host> (when given) and exits with Ray's code.
start_ray_node() {
  local block="$1" temp_dir="$2" log_copy_dir="$3"
  shift 3
  mkdir -p "$temp_dir"
  # The mark scripts/stop.sh finds this node's processes by (they all inherit it from `ray start`).
  export MEGARL_RAY_NODE_TEMP_DIR="$temp_dir"
  if [ "$block" = 1 ] && [ -z "$log_copy_dir" ]; then
    exec ray start "$@" --block
  fi
  if [ "$block" = 1 ]; then
    ray start "$@" --block &
    ray_pid=$!
    # Ray stops its processes on SIGTERM; the logs are copied once it has.
    signalled=1
    trap 'signalled=1; kill -TERM "$ray_pid" 2>/dev/null || true' TERM INT
    local rc=0
    # A trapped signal ends `wait` early (status 128+N): wait again, for Ray's own exit status.
    while [ "$signalled" = 1 ]; do
      signalled=0
      rc=0
      wait "$ray_pid" || rc=$?
    done
    copy_ray_logs "$temp_dir" "$log_copy_dir"
    exit "$rc"
  fi
  ray start "$@" \
    || fail "\`ray start $*\` failed (see Ray's message above); clean up with: bash scripts/stop.sh --temp-dir $temp_dir"
}

# copy_ray_logs TEMP_DIR DIR: this node's Ray logs (TEMP_DIR/session_latest/logs) to DIR/<host>/logs, e.g. on
# shared storage; the node-local temp dir goes with the node. A failed copy is reported, not fatal.
copy_ray_logs() {
  local dest
  dest="$2/$(hostname)"
  if mkdir -p "$dest" && cp -r "$1/session_latest/logs" "$dest/"; then
    echo "$prog: Ray logs copied to $dest/logs"
  else
    echo "$prog: WARNING: could not copy Ray's logs from $1/session_latest/logs to $dest" >&2
  fi
}
