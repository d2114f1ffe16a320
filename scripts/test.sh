#!/usr/bin/env bash
# Set up .venv (idempotent), then run the whole test suite: unit, distributed, e2e, deploy.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "Usage: bash scripts/test.sh [pytest args...]"
  echo "Sets up .venv (scripts/setup.sh) and runs the test suite with pytest (default: all of tests/),"
  echo "then lists the 25 slowest tests (of those over 1 s)."
  echo "The fast lane: bash scripts/test.sh -m \"not slow\" (all but the long fault and soak tests)."
  exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
echo "test.sh: running pytest $*"
# --durations: the slowest tests are listed at the end of every run, so a test that grows shows up.
exec "$root/.venv/bin/python" -m pytest -p no:cacheprovider --durations=25 --durations-min=1.0 "$@"
