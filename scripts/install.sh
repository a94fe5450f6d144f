#!/usr/bin/env bash
# Install hpc-ddp on a Debian/Ubuntu machine: system packages (Slurm for the embedded local
# cluster, pdsh, ClusterShell) and a virtualenv in .venv with the toolkit and every extra
# (hpc-ddp[all]: training, submitit, TensorBoard) installed editable.
#   scripts/install.sh            the toolkit and its runtime needs
#   scripts/install.sh --test     plus the test and lint tools
#   --cpu                         PyTorch's CPU-only build (the default where no NVIDIA GPU is)
#   --cuda                        PyPI's torch with its CUDA libraries (the default beside a GPU)
#   --dry-run                     say what it would do and why, change nothing
# HPC_DDP_TORCH_CPU_INDEX: where the CPU build comes from (default PyTorch's own index,
# https://download.pytorch.org/whl/cpu; a mirror of it works, file:// too).
# Idempotent: a second run only checks. Needs root (or sudo) for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '5,11p' "$0" | sed 's/^# \{0,1\}/  /'; }
test_tools=0
build=""
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --test) test_tools=1 ;;
    --cpu | --cuda)
      if [ -n "$build" ] && [ "$build" != "${arg#--}" ]; then
        echo "install: --cpu and --cuda exclude each other: give one of them" >&2
        exit 2
      fi
      build="${arg#--}"
      ;;
    --dry-run) dry_run=1 ;;
    -h | --help)
      echo "usage: scripts/install.sh [--test] [--cpu | --cuda] [--dry-run]"
      usage
      exit 0
      ;;
    *)
      echo "install: unknown option '$arg'; usage: scripts/install.sh [--test] [--cpu | --cuda]" \
        "[--dry-run] (--help says more)" >&2
      exit 2
      ;;
  esac
done
extras="[all]"
[ "$test_tools" = 1 ] && extras="[all,test]"

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
APT_PACKAGES=(slurm-wlm slurm-client munge pdsh clustershell)
# The tests try to pass as root with fakeroot against the local cluster (and must fail).
[ "$test_tools" = 1 ] && APT_PACKAGES+=(fakeroot)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then missing+=(python3-venv); fi
# torch 2.14.1 + torchvision 0.29.1: on x86_64 the newest pair whose torchvision imports beside
# its torch from the wheels this installer can reach (torch 2.13.0+cpu has no working torchvision).
TORCH_PINS=("torch==2.14.1" "torchvision==0.29.1")
CPU_INDEX="${HPC_DDP_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

# The build of the torch in .venv (cpu or cuda, from torch/version.py, without importing torch)
# when .venv holds the pinned pair; nothing otherwise.
installed_build() {
  [ -x .venv/bin/python ] || return 0
  .venv/bin/python - "${TORCH_PINS[@]}" <<'PY' 2>/dev/null || true
import re
import sys
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

pins = [pin.split("==") for pin in sys.argv[1:]]
if all(version(name).split("+")[0] == want for name, want in pins):
    with open(Path(find_spec("torch").origin).with_name("version.py")) as f:
        cuda = re.search(r"^cuda\b[^=]*=\s*(.*)$", f.read(1 << 16), re.M)
    print("cpu" if cuda and cuda.group(1).strip() == "None" else "cuda")
PY
}

label() { if [ "$1" = cpu ]; then echo "CPU-only"; else echo "CUDA"; fi; }

# Why this machine counts as having an NVIDIA GPU; nothing when it does not.
nvidia_gpu() {
  if command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "nvidia-smi lists a GPU"
  elif [ -e /proc/driver/nvidia ]; then
    echo "/proc/driver/nvidia exists"
  elif [ -e /dev/nvidia0 ]; then
    echo "/dev/nvidia0 exists"
  fi
}

# Whether the index $1 offers torch $2 (its simple page names the wheels); says why not.
index_offers_torch() {
  python3 - "$1" "$2" <<'PY'
import sys
import urllib.request

index, want = sys.argv[1].rstrip("/"), sys.argv[2]
# A file:// index is a tree of directories: pip reads each one's index.html, as this does.
url = f"{index}/torch/" + ("index.html" if index.startswith("file:") else "")
try:
    with urllib.request.urlopen(url, timeout=20) as page:
        text = page.read(64 << 20).decode("utf-8", "replace").replace("%2B", "+")
except Exception as err:  # any failure to read it means: not from there
    sys.exit(f"{url} cannot be read ({err})")
if f"torch-{want}+" not in text and f"torch-{want}-" not in text:
    sys.exit(f"{url} offers no torch {want}")
PY
}

# Say up front what this run will do, why, and roughly how big it is.
echo "install: hpc-ddp${extras} into .venv (editable from $PWD)"
if [ ${#missing[@]} -gt 0 ]; then
  echo "install:   apt packages: ${missing[*]} (with dependencies, about 30 MB)"
else
  echo "install:   apt packages: all present (${APT_PACKAGES[*]})"
fi

# Which torch build, and why: asked for, or what this machine's GPU (or its absence) calls for.
explicit=0
if [ -n "$build" ]; then
  explicit=1
  why="asked for with --$build"
else
  gpu=$(nvidia_gpu)
  if [ -n "$gpu" ]; then
    build=cuda
    why="an NVIDIA GPU is present: $gpu; --cpu installs the CPU-only build instead"
  else
    build=cpu
    why="no NVIDIA GPU here: nvidia-smi lists none, no /proc/driver/nvidia, no /dev/nvidia0;"
    why+=" --cuda installs the CUDA build instead"
  fi
fi
have=$(installed_build)
torch_download=1
if [ -n "$have" ] && { [ "$explicit" = 0 ] || [ "$have" = "$build" ]; }; then
  torch_download=0  # a build already installed is kept unless the other one is asked for
elif [ "$build" = cpu ] && ! reason=$(index_offers_torch "$CPU_INDEX" "${TORCH_PINS[0]#*==}" 2>&1); then
  if [ "$explicit" = 1 ]; then
    echo "install: --cpu: $reason" >&2
    echo "install: HINT: point HPC_DDP_TORCH_CPU_INDEX at a mirror of PyTorch's CPU index that" \
      "this machine reaches, or leave out --cpu to install PyPI's torch with its CUDA libraries" >&2
    exit 1
  fi
  echo "install: WARNING: the CPU-only torch cannot come from $CPU_INDEX: $reason" >&2
  echo "install: WARNING: installing PyPI's torch instead, with CUDA libraries this machine" \
    "cannot use (a download of a few GB; it trains on the CPU all the same)" >&2
  echo "install: WARNING: for the CPU-only build, point HPC_DDP_TORCH_CPU_INDEX at a mirror of" \
    "that index and run scripts/install.sh --cpu; --cuda skips this check" >&2
  build=cuda
  why="no NVIDIA GPU here, but the CPU-only build cannot be had: the warning above"
fi
[ "$torch_download" = 1 ] && [ -n "$have" ] && why+="; it replaces the $(label "$have") build in .venv"

if [ "$torch_download" = 0 ]; then
  kept=""
  [ "$have" != "$build" ] && kept="; --$build would replace it with the $(label "$build") one"
  echo "install:   ${TORCH_PINS[*]}: present in .venv (the $(label "$have") build$kept)," \
    "nothing to download"
elif [ "$build" = cpu ]; then
  echo "install:   ${TORCH_PINS[*]}, CPU-only build from $CPU_INDEX: a download of a few" \
    "hundred MB ($why)"
else
  echo "install:   ${TORCH_PINS[*]} with their CUDA libraries from PyPI: a download of a few GB" \
    "(about 5.5 GB in .venv), minutes on a fast link ($why)"
fi
if [ "$dry_run" = 1 ]; then
  echo "install: --dry-run: nothing installed, nothing changed"
  exit 0
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
# A download shows pip's lines (one per package) and, on a terminal only, its progress bars: a CI
# log gets the lines without the bars. A rerun, with the pair present, only checks, quietly.
pip_output=(-q)
if [ "$torch_download" = 1 ]; then
  pip_output=(--progress-bar off)
  [ -t 1 ] && pip_output=(--progress-bar on)
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "$torch_download" = 1 ] && [ -n "$have" ]; then
  echo "install: pip uninstall torch torchvision (the $(label "$have") build, for the $(label "$build") one)"
  .venv/bin/python -m pip uninstall -y -q torch torchvision
fi
if [ "$torch_download" = 1 ] && [ "$build" = cpu ]; then
  # Only the torch pair from that index (it mirrors their dependencies); the rest from PyPI
  # below, where the pair installed here already satisfies the pins.
  echo "install: pip install --index-url $CPU_INDEX ${TORCH_PINS[*]}"
  .venv/bin/python -m pip install "${pip_output[@]}" --index-url "$CPU_INDEX" "${TORCH_PINS[@]}"
fi
[ "$torch_download" = 1 ] && echo "install: pip install ${TORCH_PINS[*]} -e .${extras}"
.venv/bin/python -m pip install "${pip_output[@]}" "${TORCH_PINS[@]}" -e ".${extras}"
echo "install: ok ($(.venv/bin/python -c 'import torch
print("torch", torch.__version__, f"(CUDA {torch.version.cuda})" if torch.version.cuda else "(CPU only)")'))"
echo "install: the commands are in .venv/bin: source .venv/bin/activate (or run .venv/bin/hpc-ddp)"
