"""What ``render`` says a job will run and assume, and ``doctor --job`` checking it here.

The interpreter checks run real interpreters: this one (which imports hpc_ddp and torch), one
that does not exist, and one that exists but cannot import torch (``python3 -I``-style: a
wrapper script that runs this interpreter in isolated mode, with no hpc_ddp on its path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.deploy.job_assumptions import of_script, of_spec, summary_lines
from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.doctor_checks.job import job_checks


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "hpc_ddp.cli", *argv],
        capture_output=True, text=True, cwd=cwd, timeout=120, env=env,
    )  # fmt: skip


def test_render_says_what_the_job_runs_and_assumes(tmp_path: Path) -> None:
    proc = _cli(
        "render", "--nodes", "4", "--gpus-per-node", "8", "--launcher", "torchrun",
        "--script-out", "job.sbatch", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "torchrun ... -m hpc_ddp.train" in err, err
    assert "interpreter: torchrun's own, from the compute nodes' PATH (no setup lines" in err
    assert "assumes: hpc_ddp and torch import with that interpreter" in err, err
    assert "run dir: runs/train (relative to the submission directory)" in err, err
    assert "data: cifar10 in data (relative to the submission directory), downloaded" in err
    assert "srun -N1 hpc-ddp doctor --job job.sbatch" in err, err
    assert proc.stdout == ""  # the summary never mixes into a printed script


def test_summary_of_an_absolute_interpreter_with_setup() -> None:
    spec = JobSpec(
        python="/opt/venv/bin/python", setup=["module load cuda"],
        workdir="/scratch/me", args=["--synthetic", "--run-dir", "r"],
    )  # fmt: skip
    text = "\n".join(summary_lines(of_spec(spec)))
    assert "srun starts every process): /opt/venv/bin/python -m hpc_ddp.train" in text
    assert "/opt/venv/bin/python, which must exist on every compute node" in text
    assert "run dir: r (relative to /scratch/me)" in text and "synthetic cifar10" in text


def _check(spec: JobSpec, tmp_path: Path) -> dict[str, tuple[str, str]]:
    found = of_script(render(spec, command="tests"))  # through the script, as doctor reads it
    assert found is not None and found.python == spec.python
    return {c.name: (c.status, c.detail) for c in job_checks(found, tmp_path)}


def test_doctor_job_checks_the_interpreter_and_the_data_dir(tmp_path: Path) -> None:
    good = _check(JobSpec(python=sys.executable, args=["--synthetic"]), tmp_path)
    assert good["job interpreter"] == ("OK", f"{sys.executable} imports hpc_ddp, torch")
    assert good["data dir"][0] == "OK"
    missing = _check(JobSpec(python=str(tmp_path / "nope"), args=["--data-dir", "d"]), tmp_path)
    assert missing["job interpreter"][0] == "FAIL", missing
    assert "is not found here" in missing["job interpreter"][1]
    assert missing["data dir"][0] == "WARN" and "will download cifar10" in missing["data dir"][1]
    isolated = tmp_path / "isolated-python"
    isolated.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    isolated.chmod(0o755)
    bare = _check(JobSpec(python=str(isolated), args=["--no-download"]), tmp_path)
    status, detail = bare["job interpreter"]
    assert status == "FAIL" and "cannot `import hpc_ddp, torch`" in detail, detail
    assert bare["data dir"][0] == "FAIL", bare


def test_doctor_job_cli(tmp_path: Path) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(f'python = "{sys.executable}"\nargs = ["--synthetic", "--run-dir", "r"]\n')
    proc = _cli("doctor", "--job", str(spec), cwd=tmp_path)
    assert "OK   job interpreter" in proc.stdout, proc.stdout + proc.stderr
    # The job's run dir is the one checked, where the job resolves it; doctor creates nothing.
    assert f"r does not exist yet; {tmp_path}, where the trainer creates it," in proc.stdout


@pytest.mark.slurm
def test_doctor_job_inside_an_allocation(slurm_cluster, tmp_path: Path) -> None:
    """``srun hpc-ddp doctor --job`` on a node of the real local cluster: the rendered job's
    interpreter (this one) imports hpc_ddp and torch there, its run dir is writable there."""
    script = tmp_path / "job.sbatch"
    spec = JobSpec(python=sys.executable, args=["--synthetic", "--run-dir", "r"])
    script.write_text(render(spec, command="tests"))
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = slurm_cluster.run(
        ["srun", "-N1", "--export", f"ALL,PYTHONPATH={env['PYTHONPATH']}", sys.executable,
         "-m", "hpc_ddp.cli", "doctor", "--job", str(script)],
        check=False, cwd=tmp_path, timeout_s=180,
    )  # fmt: skip
    out = proc.stdout
    assert f"OK   job interpreter: {sys.executable} imports hpc_ddp, torch" in out, out
    assert f"r does not exist yet; {tmp_path}, where the trainer creates it, is writable" in out
    assert "allocation" in out, out  # the doctor saw it ran inside a job
