#!/usr/bin/env bash
# Lint and run the whole test suite (real Slurm daemons, torchrun, Gloo, pdsh, clush; GPU tests
# skip where no GPU is visible). Extra arguments go to pytest, e.g. scripts/test.sh -k slurm.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/pytest -ra "$@"
