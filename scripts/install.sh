#!/usr/bin/env bash
# Install hpc-ddp on a Debian/Ubuntu machine: system packages (Slurm for the embedded local
# cluster, pdsh, ClusterShell) and a virtualenv in .venv with the toolkit installed editable.
#   scripts/install.sh          the toolkit and its runtime needs
#   scripts/install.sh --test   plus the test and lint tools
# Idempotent: a second run only checks. Needs root (or sudo) for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every extra: the toolkit's core, training (torch) and submitit; --test adds the test tools.
extras="[all]"
[ "${1:-}" = "--test" ] && extras="[all,test]"

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
APT_PACKAGES=(slurm-wlm slurm-client munge pdsh clustershell)
# The tests try to pass as root with fakeroot against the local cluster (and must fail).
[ -n "$extras" ] && APT_PACKAGES+=(fakeroot)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then missing+=(python3-venv); fi
TORCH_PINS=("torch==2.14.1" "torchvision==0.29.1")
# Whether .venv already holds the pinned torch pair: then pip only checks (quietly, seconds).
pinned() {
  [ -x .venv/bin/python ] && .venv/bin/python - "${TORCH_PINS[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (pin.split("==") for pin in sys.argv[1:])))
PY
}

# Say up front what this run will do and roughly how big it is.
echo "install: hpc-ddp${extras} into .venv (editable from $PWD)"
if [ ${#missing[@]} -gt 0 ]; then
  echo "install:   apt packages: ${missing[*]} (with dependencies, about 30 MB)"
else
  echo "install:   apt packages: all present (${APT_PACKAGES[*]})"
fi
if pinned; then
  echo "install:   ${TORCH_PINS[*]}: present in .venv, nothing to download"
else
  echo "install:   ${TORCH_PINS[*]} with their CUDA libraries: a download of a few GB" \
    "(about 5.5 GB in .venv), minutes on a fast link"
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "install: apt-get update && apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian enables and starts the daemons it installs; the toolkit runs its own, so stop those.
for svc in slurmctld slurmd munge; do
  if command -v systemctl >/dev/null && systemctl is-active --quiet "$svc" 2>/dev/null; then
    $SUDO systemctl stop "$svc" || true
  fi
done

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch 2.14.1 + torchvision 0.29.1: on x86_64 the newest pair whose torchvision imports beside
# its torch from the wheels this installer can reach (torch 2.13.0+cpu has no working torchvision).
# A download shows pip's lines (one per package) and, on a terminal only, its progress bars: a CI
# log gets the lines without the bars. A rerun, with the pair present, only checks, quietly.
if pinned; then
  pip_output=(-q)
else
  echo "install: pip install ${TORCH_PINS[*]} -e .${extras}"
  pip_output=(--progress-bar off)
  [ -t 1 ] && pip_output=(--progress-bar on)
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install "${pip_output[@]}" "${TORCH_PINS[@]}" -e ".${extras}"
echo "install: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
echo "install: the commands are in .venv/bin: source .venv/bin/activate (or run .venv/bin/hpc-ddp)"
