#!/usr/bin/env bash
# Start a Ray head node for megarl and wait until it is healthy (GCS answers, job API listens).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/ray_head.sh [options] [-- extra `ray start` arguments]

Starts the Ray head node (GCS, dashboard with the job API) and returns once it is healthy:
`ray health-check` succeeds and the dashboard port accepts connections, polled up to --timeout
seconds. Stop it with `bash scripts/stop.sh --temp-dir <same dir>`.

Options:
  --port PORT              GCS port (default 6379)
  --node-ip-address ADDR   address other nodes reach this node at (default: Ray picks the node's IP;
                           Ray never advertises 127.0.0.1, and its GCS/raylet listen on all interfaces)
  --iface IFNAME           network interface for Ray, NCCL and Gloo: sets NCCL_SOCKET_IFNAME and
                           GLOO_SOCKET_IFNAME, and the node IP to the interface's IPv4 address
  --dashboard-host ADDR    where the dashboard and job API listen (default 127.0.0.1: this machine
                           only; use 0.0.0.0 to submit jobs from other machines, on a trusted network)
  --dashboard-port PORT    dashboard / job API port (default 8265)
  --num-cpus N             CPUs Ray may schedule on this node (default: all)
  --num-gpus N             GPUs Ray may schedule on this node (default: all visible)
  --temp-dir DIR           Ray session/log directory (default: $MEGARL_RAY_TEMP_DIR, else /tmp/ray);
                           scripts/stop.sh uses it to find this node's processes
  --timeout SECONDS        how long to wait for the node to become healthy (default 60)
  --block                  run `ray start --block` in the foreground (containers, Slurm); the caller
                           checks health itself
  --log-copy-dir DIR       with --block: when Ray ends (or this script gets SIGTERM), copy its logs to
                           DIR/<host>/logs, e.g. on shared storage (the temp dir is node-local)
  -h, --help               show this help

Example (local, 2 CPUs):  bash scripts/ray_head.sh --num-cpus 2
Example (cluster):        bash scripts/ray_head.sh --iface eth0 --dashboard-host 0.0.0.0 --block
USAGE
}

prog=ray_head.sh
# shellcheck source=scripts/lib/ray_node.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/ray_node.sh"

port=6379
node_ip=""
iface=""
dashboard_host=127.0.0.1
dashboard_port=8265
num_cpus=""
num_gpus=""
temp_dir="${MEGARL_RAY_TEMP_DIR:-/tmp/ray}"
timeout_s=60
block=0
log_copy_dir=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --port) port="${2:?--port needs a value}"; shift 2 ;;
    --node-ip-address) node_ip="${2:?--node-ip-address needs a value}"; shift 2 ;;
    --iface) iface="${2:?--iface needs a value}"; shift 2 ;;
    --dashboard-host) dashboard_host="${2:?--dashboard-host needs a value}"; shift 2 ;;
    --dashboard-port) dashboard_port="${2:?--dashboard-port needs a value}"; shift 2 ;;
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
require_whole_numbers "port=$port" "dashboard-port=$dashboard_port" "timeout=$timeout_s" "num-cpus=${num_cpus:-0}" "num-gpus=${num_gpus:-0}"
[ -z "$log_copy_dir" ] || [ "$block" = 1 ] || bad_arg "--log-copy-dir needs --block (the logs are copied when the blocking Ray node ends)"
require_ray

if [ -n "$iface" ]; then
  use_iface "$iface"
  node_ip="$iface_ip"
fi

args=(--head --port "$port" --dashboard-host "$dashboard_host" --dashboard-port "$dashboard_port"
      --temp-dir "$temp_dir" --disable-usage-stats)
[ -n "$node_ip" ] && args+=(--node-ip-address "$node_ip")
[ -n "$num_cpus" ] && args+=(--num-cpus "$num_cpus")
[ -n "$num_gpus" ] && args+=(--num-gpus "$num_gpus")
args+=("${extra[@]}")

start_ray_node "$block" "$temp_dir" "$log_copy_dir" "${args[@]}"

gcs_address="${node_ip:-127.0.0.1}:$port"
dashboard_probe_host="$dashboard_host"
[ "$dashboard_probe_host" = 0.0.0.0 ] && dashboard_probe_host=127.0.0.1
deadline=$((SECONDS + timeout_s))
until timeout 30 ray health-check --address "$gcs_address" >/dev/null 2>&1 \
      && (exec 3<>"/dev/tcp/$dashboard_probe_host/$dashboard_port") 2>/dev/null; do
  [ "$SECONDS" -lt "$deadline" ] \
    || fail "the head did not become healthy within ${timeout_s}s (GCS $gcs_address, dashboard $dashboard_probe_host:$dashboard_port); logs: $temp_dir/session_latest/logs; stop it with: bash scripts/stop.sh --temp-dir $temp_dir"
  sleep 1
done
echo "ray_head.sh: Ray head is up. GCS: $gcs_address  job API: http://$dashboard_probe_host:$dashboard_port"
echo "ray_head.sh: submit: bash scripts/submit.sh --address http://$dashboard_probe_host:$dashboard_port -- <command>"
echo "ray_head.sh: stop:   bash scripts/stop.sh --temp-dir $temp_dir"
