#!/usr/bin/env bash
# Join a megarl Ray cluster as a worker node once the head answers its health check.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/ray_worker.sh --address HEAD_IP:PORT [options] [-- extra `ray start` arguments]

Polls the head's GCS with `ray health-check` (every 2 s, up to --timeout seconds) and then starts
a Ray worker node that joins it. Fails with a clear message if the head never becomes healthy.
Stop it with `bash scripts/stop.sh --temp-dir <same dir>`.

Options:
  --address HEAD_IP:PORT   the head's GCS address (required), e.g. 10.0.0.1:6379
  --node-ip-address ADDR   address other nodes reach this node at (default: Ray picks the node's IP)
  --iface IFNAME           network interface for Ray, NCCL and Gloo: sets NCCL_SOCKET_IFNAME and
                           GLOO_SOCKET_IFNAME, and the node IP to the interface's IPv4 address
  --num-cpus N             CPUs Ray may schedule on this node (default: all)
  --num-gpus N             GPUs Ray may schedule on this node (default: all visible)
  --temp-dir DIR           Ray session/log directory (default: $MEGARL_RAY_TEMP_DIR, else /tmp/ray)
  --timeout SECONDS        how long to wait for the head (default 300)
  --block                  run `ray start --block` in the foreground (containers, Slurm)
  --log-copy-dir DIR       with --block: when Ray ends (or this script gets SIGTERM), copy its logs to
                           DIR/<host>/logs, e.g. on shared storage (the temp dir is node-local)
  -h, --help               show this help
USAGE
}

prog=ray_worker.sh
# shellcheck source=scripts/lib/ray_node.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/ray_node.sh"

address=""
node_ip=""
iface=""
num_cpus=""
num_gpus=""
temp_dir="${MEGARL_RAY_TEMP_DIR:-/tmp/ray}"
timeout_s=300
block=0
log_copy_dir=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --address) address="${2:?--address needs a value}"; shift 2 ;;
    --node-ip-address) node_ip="${2:?--node-ip-address needs a value}"; shift 2 ;;
    --iface) iface="${2:?--iface needs a value}"; shift 2 ;;
    --num-cpus) num_cpus="${2:?--num-cpus needs a value}"; shift 2 ;;
    --num-gpus) num_gpus="${2:?--num-gpus needs a value}"; shift 2 ;;
    --temp-dir) temp_dir="${2:?--temp-dir needs a value}"; shift 2 ;;
    --timeout) timeout_s="${2:?--timeout needs a value}"; shift 2 ;;
    --block) block=1; shift ;;
    --log-copy-dir) log_copy_dir="${2:?--log-copy-dir needs a directory}"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) bad_arg "unknown argument '$1' (see --help)" ;;
  esac
done
[ -n "$address" ] || bad_arg "--address HEAD_IP:PORT is required (the head prints it; see --help)"
if [[ ! "$address" =~ ^[^:]+:[0-9]+$ ]]; then
  bad_arg "--address must be HOST:PORT (e.g. 10.0.0.1:6379), got '$address'"
fi
require_whole_numbers "timeout=$timeout_s" "num-cpus=${num_cpus:-0}" "num-gpus=${num_gpus:-0}"
[ -z "$log_copy_dir" ] || [ "$block" = 1 ] || bad_arg "--log-copy-dir needs --block (the logs are copied when the blocking Ray node ends)"
require_ray

if [ -n "$iface" ]; then
  use_iface "$iface"
  node_ip="$iface_ip"
fi

# The port first (refused at once while the head is down; `ray health-check` alone retries for ~45 s),
# then the GCS itself; each probe has its own time limit so --timeout holds.
head_healthy() {
  # shellcheck disable=SC2016  # $1/$2 expand in the inner shell
  timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "${address%:*}" "${address##*:}" 2>/dev/null \
    && timeout 30 ray health-check --address "$address" >/dev/null 2>&1
}

# Bounded wait for the head instead of a fixed sleep: the head may still be starting.
deadline=$((SECONDS + timeout_s))
attempt=1
until head_healthy; do
  [ "$SECONDS" -lt "$deadline" ] \
    || fail "the head at $address did not answer a health check within ${timeout_s}s ($attempt attempts). Is ray_head.sh running there, and is port ${address##*:} reachable from $(hostname)?"
  attempt=$((attempt + 1))
  sleep 2
done

args=(--address "$address" --temp-dir "$temp_dir" --disable-usage-stats)
[ -n "$node_ip" ] && args+=(--node-ip-address "$node_ip")
[ -n "$num_cpus" ] && args+=(--num-cpus "$num_cpus")
[ -n "$num_gpus" ] && args+=(--num-gpus "$num_gpus")
args+=("${extra[@]}")

start_ray_node "$block" "$temp_dir" "$log_copy_dir" "${args[@]}"
echo "ray_worker.sh: joined the cluster at $address. Stop with: bash scripts/stop.sh --temp-dir $temp_dir"
