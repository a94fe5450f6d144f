"""A plain (non-editable) install works from any directory, without torch.

Builds the wheel from this checkout, installs it with only its core dependencies into a fresh
venv (jinja2, filelock: what a login node gets from ``pip install hpc-ddp``), and runs the
commands that do not train from a directory that is not the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from slurm_support import SlurmTestCluster, clean_job_env

REPO = Path(__file__).resolve().parents[1]


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    # Never PYTHONPATH: a checkout on it would stand in for the installed package.
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/ of a fresh venv holding the built wheel and its core dependencies only."""
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(REPO),
        ],
        cwd=base,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("hpc_ddp-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    shipped = {Path(n).name for n in names if n.startswith("hpc_ddp/_templates/")}
    assert shipped == {p.name for p in (REPO / "templates").glob("*.j2")}, shipped

    venv = base / "venv"
    # The base interpreter, not this venv's: the new venv must not see torch or the checkout.
    python = getattr(sys, "_base_executable", sys.executable)
    made = _run([python, "-m", "venv", str(venv)], cwd=base)
    assert made.returncode == 0, made.stderr
    pip = _run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], cwd=base)
    assert pip.returncode == 0, pip.stderr
    return venv / "bin"


def _env(bindir: Path, **extra: str) -> dict[str, str]:
    env = clean_job_env(**extra)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    return env


def test_core_install_has_no_torch_and_imports_lazily(wheel_venv: Path, tmp_path: Path) -> None:
    code = (
        "import sys, hpc_ddp\n"
        "assert 'torch' not in sys.modules\n"
        "assert hpc_ddp.__file__.startswith(sys.prefix), hpc_ddp.__file__\n"
        "import importlib.util as u\n"
        "print(u.find_spec('torch') is None)\n"
    )
    res = _run([str(wheel_venv / "python"), "-c", code], cwd=tmp_path, env=_env(wheel_venv))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"  # the core install really lacks torch


def test_render_and_launch_script_from_another_directory(wheel_venv: Path, tmp_path: Path) -> None:
    env = _env(wheel_venv)
    cli = str(wheel_venv / "hpc-ddp")
    res = _run(
        [
            cli,
            "render",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--launcher",
            "torchrun",
            "-o",
            "job.sbatch",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=4" in text and "torchrun" in text

    res = _run(
        [
            cli,
            "launch",
            "pdsh",
            "--hosts",
            "node[01-02]",
            "--gpus-per-node",
            "2",
            "--render-script",
            "launch.sh",
            "--",
            "--epochs",
            "1",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "launch.sh").read_text().startswith("#!")

    res = _run([cli, "env", "--json"], cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert '"world_size": 1' in res.stdout


def test_missing_extras_are_named(wheel_venv: Path, tmp_path: Path) -> None:
    env = _env(wheel_venv)
    cli = str(wheel_venv / "hpc-ddp")
    res = _run([cli, "train", "--epochs", "1"], cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr
    assert "hpc-ddp[train]" in res.stderr and "Traceback" not in res.stderr

    spec = tmp_path / "spec.toml"
    spec.write_text('nodes = 1\nprocs_per_node = 1\nargs = ["--epochs", "1"]\n')
    res = _run([cli, "submit", "--executor", "local", str(spec)], cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr
    assert "hpc-ddp[submitit]" in res.stderr and "Traceback" not in res.stderr

    res = _run([cli, "render", "--all-examples"], cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr
    assert "checkout" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slurm
def test_submit_from_the_installed_wheel(
    wheel_venv: Path, tmp_path: Path, slurm_cluster: SlurmTestCluster
) -> None:
    """sbatch submission renders from the wheel's templates and reaches the real Slurm."""
    spec = tmp_path / "spec.toml"
    spec.write_text(
        'name = "wheel-smoke"\nnodes = 1\nprocs_per_node = 1\ntime = "00:05:00"\n'
        f'output = "{tmp_path}/%x-%j.out"\nmodule = "this"\npreflight = false\n'
    )
    env = _env(wheel_venv, **slurm_cluster.cluster.env())
    res = _run(
        [str(wheel_venv / "hpc-ddp"), "submit", "--no-wait", str(spec)], cwd=tmp_path, env=env
    )
    assert res.returncode == 0, res.stderr
    assert "job" in res.stdout.lower()
