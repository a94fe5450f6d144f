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
if [ ${#missing[@]} -gt 0 ]; then
  echo "install: apt-get install ${missing[*]}"
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
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1" -e ".${extras}"
echo "install: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
