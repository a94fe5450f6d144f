#!/usr/bin/env bash
# Lint and run the whole test suite (real Slurm daemons, torchrun, Gloo, pdsh, clush; GPU tests
# skip where no GPU is visible). Extra arguments go to pytest, e.g. scripts/test.sh -k slurm.
# The tests run in parallel (pytest-xdist), one more worker than CPUs: many of them wait on
# Slurm's scheduling and requeues, process start-up or rendezvous with the CPUs idle. Each test
# file stays on one worker (--dist loadfile: its module fixtures run once), the files that took
# longest first (tests/durations.json, tests/conftest.py); each worker starts its own local Slurm
# clusters.
# `scripts/test.sh -n 0 ...` runs serially. Every 30 s a line says how many tests are done of
# all, how many failed and the time so far (tests/conftest.py; --progress-every SECONDS).
# `scripts/test.sh --quick`: the inner loop's tier, the tests under a second each in
# tests/durations.json (tests/quick_tier.py); `--record-durations` on a full run rewrites it.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite starts thousands of interpreters: each reuses the modules compiled before it (and
# pytest its rewritten test modules) only where bytecode may be written, into the __pycache__
# directories git ignores. With PYTHONDONTWRITEBYTECODE set, every one of them compiled them
# again (benchmarks/NOTES.md).
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check .
.venv/bin/ruff format --check .
parallel=()
if .venv/bin/python -c "import xdist" 2>/dev/null; then
  workers=$(($(nproc) + 1))
  ((workers > 8)) && workers=8  # beyond that, more local clusters than the tests need
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
else
  echo "test: pytest-xdist is missing (scripts/install.sh --test adds it): running serially" >&2
fi
exec .venv/bin/pytest -ra "${parallel[@]}" "$@"
