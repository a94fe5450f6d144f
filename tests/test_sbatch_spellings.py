"""sbatch's own spellings on ``hpc-ddp render`` (-J, -N, -p, -A, -t, --chdir, --signal=SIG@N),
render's script file under a name sbatch users cannot misread (``--script-out``; ``-o`` is
no flag of render), and ``submit --wait-timeout``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.errors import ConfigError


def _cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_ddp.cli", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def _directives(text: str) -> set[str]:
    return {line.removeprefix("#SBATCH ") for line in text.splitlines() if line[:7] == "#SBATCH"}


def test_sbatch_short_flags_mean_what_they_mean_to_sbatch() -> None:
    proc = _cli(
        "render", "-J", "mine", "-N", "3", "-p", "gpu", "-A", "proj", "-t", "2:00:00",
        "--chdir", "/scratch/me", "--signal=USR1@120", "--", "--run-dir", "r",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    d = _directives(proc.stdout)
    expected = {
        "--job-name=mine", "--nodes=3", "--partition=gpu", "--account=proj",
        "--time=2:00:00", "--chdir=/scratch/me", "--signal=USR1@120",
    }  # fmt: skip
    assert expected <= d, d
    long = _cli("render", "--job-name", "mine", "-D", "/scratch/me")
    assert {"--job-name=mine", "--chdir=/scratch/me"} <= _directives(long.stdout), long.stderr


def test_signal_at_seconds_sets_both_fields_and_a_contradiction_fails() -> None:
    spec = JobSpec.from_mapping({"signal": "SIGUSR2@45", "args": ["--requeue-signal", "USR2"]})
    assert (spec.signal, spec.signal_lead_s) == ("USR2", 45)
    assert JobSpec.from_mapping({"signal": "B:USR1"}).signal == "USR1"
    with pytest.raises(ConfigError, match="says 45 s before the limit, signal_lead_s says 30"):
        JobSpec.from_mapping({"signal": "USR1@45", "signal_lead_s": 30})
    with pytest.raises(ConfigError, match="signal 'KILL' is not one of"):
        JobSpec.from_mapping({"signal": "KILL@9"})  # split, then refused as an uncatchable signal


def test_script_out_writes_the_script_and_o_is_no_flag(tmp_path: Path) -> None:
    new = tmp_path / "new.sbatch"
    proc = _cli("render", "--nodes", "2", "--script-out", str(new))
    assert proc.returncode == 0 and new.is_file(), proc.stderr
    for flag in ("-o", "--output-file"):  # to sbatch users -o is the job's log
        proc = _cli("render", "--nodes", "2", flag, str(tmp_path / "x.sbatch"))
        assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr, proc.stderr
    # --output is the job's log, as for sbatch: it lands in the script, it writes no file.
    proc = _cli("render", "--output", "logs/%j.out", cwd=tmp_path)
    assert "--output=logs/%j.out" in _directives(proc.stdout), proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["new.sbatch"]


def test_submit_wait_timeout(tmp_path: Path) -> None:
    """The flag parses; nothing is submitted: the job file does not exist, so submit stops at
    its first check. ``--timeout`` is no flag of submit."""
    missing = str(tmp_path / "none.toml")
    proc = _cli("submit", missing, "--wait-timeout", "5")
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
    proc = _cli("submit", missing, "--timeout", "5")
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments: --timeout 5" in proc.stderr, proc.stderr
