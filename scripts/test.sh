#!/usr/bin/env bash
# Set up .venv (idempotent), then run the whole test suite: unit, distributed, e2e, deploy.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "Usage: bash scripts/test.sh [pytest args...]"
  echo "Sets up .venv (scripts/setup.sh) and runs the test suite with pytest (default: all of tests/) in two"
  echo "processes (pytest-xdist, a test file per process at a time), then lists the 25 slowest tests (over 1 s)"
  echo "and the 25 that cost the most CPU-seconds, every process they start included (tests/cpu_cost.py)."
  echo "One process (for -s, --pdb or a debugger): add -n 0."
  echo "The fast lane: bash scripts/test.sh -m \"not slow\" (all but the long fault and soak tests)."
  exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
echo "test.sh: running pytest $*"
# --durations: the slowest tests are listed at the end of every run, so a test that grows shows up; --cpu-report:
# the costliest in CPU-seconds (tests/cpu_cost.py): on two busy cores the suite's wall time is its CPU-seconds / 2,
# and a test that waits (a hang timeout) lasts long but costs little.
# -n 2: a whole training job keeps two cores about 60 % busy (Ray, vLLM and Megatron start-ups wait on each
# other), so a second process fills the gaps; --dist loadfile keeps a file's tests, and so its module-scoped
# runs, in one process. tests/conftest.py orders the files longest first, and --no-loadscope-reorder keeps that
# order (xdist's default hands out the files with the most tests first: unit files, leaving the whole jobs for
# the end). "-n 0" after these runs one process.
exec "$root/.venv/bin/python" -m pytest -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=25 --durations-min=1.0 \
  -p tests.cpu_cost --cpu-report=25 "$@"
