#!/usr/bin/env bash
# Lint and run the whole test suite (real Slurm daemons, torchrun, Gloo, pdsh, clush; GPU tests
# skip where no GPU is visible). Extra arguments go to pytest, e.g. scripts/test.sh -k slurm.
# The tests run in parallel (pytest-xdist), one more worker than CPUs: many of them wait on
# Slurm's scheduling and requeues, process start-up or rendezvous with the CPUs idle. Each test
# file stays on one worker (--dist loadfile: its module fixtures run once); each worker starts
# its own local Slurm clusters. `scripts/test.sh -n 0 ...` runs serially.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
workers=$(($(nproc) + 1))
((workers > 8)) && workers=8  # beyond that, more local clusters than the tests need
exec .venv/bin/pytest -ra -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
