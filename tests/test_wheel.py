"""A plain (non-editable) install works from any directory, without torch, on every Python the
package claims.

Builds the wheel from this checkout once, installs it with only its core dependencies into a
fresh venv per interpreter (jinja2, filelock, tomli: what a login node gets from
``pip install hpc-ddp``), and runs the commands that do not train from a directory that is not
the checkout. The interpreters are the suite's own plus every other claimed minor version found
on this machine (``python3.X`` on PATH, or pyenv's versions).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from slurm_support import SlurmTestCluster, clean_job_env

from hpc_ddp.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
CLAIMED_MINORS = range(10, 14)  # pyproject's requires-python >=3.10, up to the newest tested


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    # Never PYTHONPATH: a checkout on it would stand in for the installed package.
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _minor_of(python: str) -> int | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out[1]) if len(out) == 2 and out[0] == "3" else None


def _other_pythons() -> dict[str, str]:
    """'3.X' -> an interpreter of that claimed version other than the suite's own minor."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found: dict[str, str] = {}
    for minor in CLAIMED_MINORS:
        if minor == sys.version_info.minor:
            continue
        candidates = [shutil.which(f"python3.{minor}")]
        candidates += sorted(str(p) for p in pyenv.glob(f"3.{minor}.*/bin/python3.{minor}"))
        for python in filter(None, candidates):
            if _minor_of(python) == minor:  # a pyenv shim of a version not enabled fails here
                found[f"3.{minor}"] = python
                break
    return found


OTHER_PYTHONS = _other_pythons()


@pytest.fixture(scope="module")
def wheel_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, with the templates shipped inside it."""
    dist = tmp_path_factory.mktemp("dist")
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
        cwd=dist,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("hpc_ddp-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    shipped = {Path(n).name for n in names if n.startswith("hpc_ddp/_templates/")}
    assert shipped == {p.name for p in (REPO / "templates").glob("*.j2")}, shipped
    return wheel


def _install(python: str, wheel: Path, base: Path) -> Path:
    """bin/ of a fresh venv of ``python`` holding the wheel and its core dependencies only.

    The venv gets no pip of its own: the suite's pip installs into it (``--python``), as a user's
    pip would. Seeding each venv with pip cost more CPU than the rest of its test."""
    venv = base / "venv"
    made = _run([python, "-m", "venv", "--without-pip", str(venv)], cwd=base)
    assert made.returncode == 0, made.stderr
    target = str(venv / "bin" / "python")
    pip = _run([sys.executable, "-m", "pip", "--python", target, "install", "-q", str(wheel)], base)
    assert pip.returncode == 0, pip.stderr
    return venv / "bin"


@pytest.fixture(scope="module")
def wheel_venv(wheel_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The base interpreter, not this venv's: the new venv must not see torch or the checkout.
    python = getattr(sys, "_base_executable", sys.executable)
    return _install(python, wheel_file, tmp_path_factory.mktemp("wheel"))


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


def test_doctor_on_a_login_node_without_torch_passes_and_creates_nothing(
    wheel_venv: Path, tmp_path: Path
) -> None:
    """What the core install is for: `hpc-ddp doctor` on a login node, torch absent for real
    (this venv never had it). The torch line says so and is skipped, nothing FAILs, and the
    doctor leaves no `runs` in the directory it ran in and no state dir in HOME."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = _env(wheel_venv, HOME=str(home))
    for name in ("XDG_STATE_HOME", "XDG_RUNTIME_DIR"):
        env.pop(name, None)
    res = _run([str(wheel_venv / "hpc-ddp"), "doctor"], cwd=work, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    torch_line = next(line for line in res.stdout.splitlines() if line[5:].startswith("torch:"))
    assert torch_line.startswith("OK") and "not installed here" in torch_line, torch_line
    assert "--no-torch" in torch_line, torch_line
    assert "runs does not exist yet" in res.stdout, res.stdout
    assert list(work.iterdir()) == [] and list(home.iterdir()) == []


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
            "--script-out",
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


def _commands_work(bindir: Path, cwd: Path) -> None:
    """Every subcommand's --help, a render and env, from a directory that is not the checkout."""
    env = _env(bindir)
    cli = str(bindir / "hpc-ddp")
    for command in ["", *COMMANDS]:
        res = _run([cli, *([command] if command else []), "--help"], cwd=cwd, env=env)
        assert res.returncode == 0 and "Traceback" not in res.stderr, (command, res.stderr)
        assert res.stdout.startswith("usage: hpc-ddp"), (command, res.stdout)
    res = _run(
        [cli, "render", "-N", "2", "--gpus-per-node", "4", "--script-out", "job.sbatch"],
        cwd=cwd,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --nodes=2" in (cwd / "job.sbatch").read_text()
    res = _run([cli, "env", "--json"], cwd=cwd, env=env)
    assert res.returncode == 0, res.stderr
    assert re.search(r'"world_size": 1\b', res.stdout), res.stdout


def test_every_command_on_the_suites_python(wheel_venv: Path, tmp_path: Path) -> None:
    _commands_work(wheel_venv, tmp_path)


@pytest.mark.parametrize("version", sorted(OTHER_PYTHONS) or ["none"])
def test_every_command_on_every_claimed_python(
    version: str, wheel_file: Path, tmp_path: Path
) -> None:
    """The core wheel on each other claimed Python found here (CI has 3.10 and 3.13 besides its
    default): Python 3.10 lacked importlib.resources.abc, and every command crashed there."""
    if version == "none":
        pytest.skip(f"no other Python 3.{CLAIMED_MINORS.start}-3.{CLAIMED_MINORS.stop - 1} here")
    bindir = _install(OTHER_PYTHONS[version], wheel_file, tmp_path)
    assert _minor_of(str(bindir / "python")) == int(version.split(".")[1])
    work = tmp_path / "work"
    work.mkdir()
    _commands_work(bindir, work)
