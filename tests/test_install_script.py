"""scripts/install.sh: which extras it installs, and which torch build it picks and says why.

The script runs with ``--dry-run`` from a copy in a temporary checkout (it works relative to its
own dir), so nothing is installed; ``PIP_NO_INDEX`` keeps pip off the network all the same, should
a dry run ever fail to stop. A GPU cannot exist here: a fake ``nvidia-smi`` that lists one stands
in for it. The CPU index is a ``file://`` one that these tests write.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.extras import EXTRAS
from hpc_ddp.schema import load_file

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install.sh"
TORCH = re.search(r'"torch==([^"]+)"', SCRIPT.read_text()).group(1)
GPU_SIGNS = (Path("/proc/driver/nvidia"), Path("/dev/nvidia0"))


def test_the_all_extra_that_install_sh_installs_holds_every_extra() -> None:
    """A missing extra's hint says scripts/install.sh installs every extra: it installs
    hpc-ddp[all], so [all] must pull in each extra the commands can ask for."""
    pyproject = load_file(REPO / "pyproject.toml", what="pyproject.toml")
    extras = pyproject["project"]["optional-dependencies"]
    (requirement,) = extras["all"]
    assert requirement.startswith("hpc-ddp[")
    assert set(requirement[len("hpc-ddp[") : -1].split(",")) == set(EXTRAS)
    assert 'extras="[all]"' in SCRIPT.read_text()


def _checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "scripts" / "install.sh")
    return tmp_path


def _index(tmp_path: Path, *wheels: str) -> str:
    """A file:// simple index whose torch page lists ``wheels``."""
    page = tmp_path / "index" / "torch" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text("".join(f'<a href="{w.replace("+", "%2B")}">{w}</a>\n' for w in wheels))
    return page.parent.parent.as_uri()


def _install(checkout: Path, *args: str, path_dirs: tuple[Path, ...] = (), **env: str):
    full = {**os.environ, "PIP_NO_INDEX": "1", **env}
    full["PATH"] = os.pathsep.join([*map(str, path_dirs), full["PATH"]])
    return subprocess.run(
        [str(checkout / "scripts" / "install.sh"), *args],
        env=full, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _no_gpu_here() -> None:
    if shutil.which("nvidia-smi") or any(sign.exists() for sign in GPU_SIGNS):
        pytest.skip("this machine has (or may have) an NVIDIA GPU: the no-GPU choice is not made")


def test_without_a_gpu_it_picks_the_cpu_build_and_says_why(tmp_path: Path) -> None:
    _no_gpu_here()
    checkout = _checkout(tmp_path / "repo")
    index = _index(tmp_path, f"torch-{TORCH}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    proc = _install(checkout, "--test", "--dry-run", HPC_DDP_TORCH_CPU_INDEX=index)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"CPU-only build from {index}: a download of a few hundred MB" in proc.stdout
    assert "(no NVIDIA GPU here: nvidia-smi lists none" in proc.stdout
    assert "--cuda installs the CUDA build instead" in proc.stdout
    assert "install: hpc-ddp[all,test] into .venv" in proc.stdout
    assert "--dry-run: nothing installed" in proc.stdout and not proc.stderr
    assert sorted(p.name for p in checkout.iterdir()) == ["scripts"]  # no .venv made


def test_an_unreachable_cpu_index_falls_back_loudly_or_fails_when_asked_for(
    tmp_path: Path,
) -> None:
    _no_gpu_here()
    checkout = _checkout(tmp_path / "repo")
    old_only = _index(tmp_path, "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    for index, why in (
        (old_only, f"offers no torch {TORCH}"),
        ((tmp_path / "absent").as_uri(), "cannot be read"),
    ):
        proc = _install(checkout, "--dry-run", HPC_DDP_TORCH_CPU_INDEX=index)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"WARNING: the CPU-only torch cannot come from {index}: " in proc.stderr
        assert why in proc.stderr
        assert "installing PyPI's torch instead, with CUDA libraries" in proc.stderr
        assert "point HPC_DDP_TORCH_CPU_INDEX at a mirror" in proc.stderr
        assert "with their CUDA libraries from PyPI" in proc.stdout
        assert "the CPU-only build cannot be had: the warning above" in proc.stdout

        asked = _install(checkout, "--cpu", "--dry-run", HPC_DDP_TORCH_CPU_INDEX=index)
        assert asked.returncode == 1, asked.stdout + asked.stderr
        assert f"install: --cpu: {index.rstrip('/')}/torch/" in asked.stderr
        assert "HINT: point HPC_DDP_TORCH_CPU_INDEX" in asked.stderr
        assert "download" not in asked.stdout
    assert sorted(p.name for p in checkout.iterdir()) == ["scripts"]


def test_beside_a_gpu_it_picks_the_cuda_build_and_flags_override(tmp_path: Path) -> None:
    """A fake nvidia-smi (no GPU can exist here) lists one: PyPI's CUDA build, and why."""
    checkout = _checkout(tmp_path / "repo")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    index = _index(tmp_path, f"torch-{TORCH}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    proc = _install(checkout, "--dry-run", path_dirs=(fake,), HPC_DDP_TORCH_CPU_INDEX=index)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "with their CUDA libraries from PyPI" in proc.stdout
    assert "(an NVIDIA GPU is present: nvidia-smi lists a GPU; --cpu installs" in proc.stdout

    cpu = _install(checkout, "--cpu", "--dry-run", path_dirs=(fake,), HPC_DDP_TORCH_CPU_INDEX=index)
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    asked = f"CPU-only build from {index}: a download of a few hundred MB (asked for with --cpu)"
    assert asked in cpu.stdout


def test_bad_options_are_refused_before_anything_runs(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path / "repo")
    for args, error in (
        (["--tset"], "install: unknown option '--tset'; usage: scripts/install.sh [--test]"),
        (["--cpu", "--cuda"], "install: --cpu and --cuda exclude each other"),
    ):
        proc = _install(checkout, *args)
        assert proc.returncode == 2 and error in proc.stderr, proc.stdout + proc.stderr
        assert not proc.stdout
    usage = _install(checkout, "--help")
    assert usage.returncode == 0 and "HPC_DDP_TORCH_CPU_INDEX" in usage.stdout
    assert sorted(p.name for p in checkout.iterdir()) == ["scripts"]
