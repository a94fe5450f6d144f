"""A thin client for one Slurm cluster: sbatch, scancel, job states, waiting with deadlines.

The one module that knows Slurm's client commands and what they print (``sbatch --parsable``,
``scontrol show job -o``, ``ExitCode=CODE:SIGNAL``, the terminal job states). The deploy layer
and the embedded cluster (hpc_ddp.localslurm) both use it; it imports neither.

No accounting runs on the local cluster (no sacct), so a job's end is read from
``scontrol show job`` while slurmctld keeps it (MinJobAge). Polling that is faster than
``sbatch --wait``, which backs off to multi-second sleeps.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from hpc_ddp.errors import HpcDdpError

T = TypeVar("T")

# States after which a job never runs again (a requeued job goes back to PENDING instead).
TERMINAL = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


def wait_for(
    condition: Callable[[], T], timeout_s: float, what: str = "condition", interval_s: float = 0.1
) -> T:
    """Poll ``condition`` until it returns something truthy; raise TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(interval_s)


@dataclass(frozen=True)
class JobResult:
    job_id: str
    state: str
    exit_code: int
    signal: int
    output_path: Path | None

    @property
    def output(self) -> str:
        """The job's stdout/stderr file, or '' if it was not written."""
        if self.output_path is None or not self.output_path.exists():
            return ""
        return self.output_path.read_text(errors="replace")


def exit_status(info: Mapping[str, str]) -> tuple[int, int]:
    """(exit code, signal) of a finished job, from ``scontrol show job``'s ExitCode=CODE:SIGNAL."""
    code, _, sig = info.get("ExitCode", "0:0").partition(":")
    return int(code or 0), int(sig or 0)


def shell_exit_code(info: Mapping[str, str]) -> int:
    """The job's exit code as a shell reports it: the code, else 128 + the signal, else 0."""
    code, sig = exit_status(info)
    return code if code else (128 + sig if sig else 0)


def restarts(info: Mapping[str, str]) -> int:
    """How often Slurm has requeued the job (0 for a first run)."""
    return int(info.get("Restarts", "0") or 0)


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` prints one line of Key=Value pairs; values never hold spaces
    except in a few trailing fields (Command, WorkDir...) we only read up to the next key."""
    fields: dict[str, str] = {}
    key = None
    for token in text.split():
        name, sep, value = token.partition("=")
        if sep and name and name[0].isupper():
            key, fields[name] = name, value
        elif key is not None:
            fields[key] += " " + token
    return fields


class SlurmClient:
    """Runs Slurm's client commands with ``env`` (which carries SLURM_CONF)."""

    def __init__(self, env: Mapping[str, str], workdir: Path | None = None) -> None:
        self.env = dict(env)
        self.workdir = workdir

    def run(
        self,
        argv: Sequence[str],
        timeout_s: float = 30,
        check: bool = True,
        cwd: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd
        )
        if check and proc.returncode != 0:
            raise HpcDdpError(
                f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()}",
                hint="is the cluster running? try `hpc-ddp cluster status`",
            )
        return proc

    def submit(
        self,
        script: Path | str,
        *args: str,
        cwd: Path | str | None = None,
        script_args: Sequence[str] = (),
    ) -> str:
        """``sbatch --parsable``; the new job's id. ``args`` are sbatch options (before the
        script), ``script_args`` the script's own arguments."""
        proc = self.run(["sbatch", "--parsable", *args, str(script), *script_args], cwd=cwd)
        job_id = proc.stdout.strip().split(";")[0]  # "id;cluster" on a federation
        if not job_id.isdigit():
            raise HpcDdpError(f"sbatch printed {proc.stdout!r}, not a job id")
        return job_id

    def sbatch(
        self,
        script: Path | str,
        *args: str,
        output: Path | None = None,
        cwd: Path | None = None,
        script_args: Sequence[str] = (),
    ) -> tuple[str, Path]:
        """Submit with the log at ``output`` (default: the workdir's slurm-%j.out); returns
        (job id, output file)."""
        out = output or (self.workdir or Path.cwd()) / "slurm-%j.out"
        job_id = self.submit(script, f"--output={out}", *args, cwd=cwd, script_args=script_args)
        return job_id, Path(str(out).replace("%j", job_id))

    def cancel(self, job_id: str) -> None:
        """``scancel``: end the job whatever its state; a job already gone is no error."""
        self.run(["scancel", job_id], check=False)

    def job_info(self, job_id: str) -> dict[str, str]:
        proc = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        return parse_show_job(proc.stdout) if proc.returncode == 0 else {}

    def job_state(self, job_id: str) -> str:
        """PENDING, RUNNING, COMPLETED, ... or UNKNOWN once slurmctld has forgotten the job."""
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: str, timeout_s: float, output_path: Path | None = None) -> JobResult:
        """Wait until the job is in a terminal state; on timeout cancel it and raise."""
        try:
            info = wait_for(
                lambda: (i := self.job_info(job_id)).get("JobState") in TERMINAL and i,
                timeout_s,
                what=f"job {job_id} to finish",
            )
        except TimeoutError as err:
            state = self.job_state(job_id)
            self.cancel(job_id)
            tail = ""
            if output_path and output_path.exists():
                tail = "\n".join(output_path.read_text(errors="replace").splitlines()[-20:])
            msg = f"{err} (state {state}); cancelled it. Output tail:\n{tail}"
            raise TimeoutError(msg) from err
        code, sig = exit_status(info)
        return JobResult(job_id, info["JobState"], code, sig, output_path)

    def sbatch_wait(
        self,
        script: Path | str,
        *args: str,
        timeout_s: float = 60,
        output: Path | None = None,
        cwd: Path | None = None,
        script_args: Sequence[str] = (),
    ) -> JobResult:
        job_id, out = self.sbatch(script, *args, output=output, cwd=cwd, script_args=script_args)
        return self.wait_job(job_id, timeout_s, out)

    def srun(
        self, argv: Sequence[str], timeout_s: float = 60, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``srun`` outside any allocation; returns the finished process whatever its exit code."""
        return self.run(["srun", *argv], timeout_s=timeout_s, check=False, cwd=cwd)

    @staticmethod
    def wait_for(condition: Callable[[], T], timeout_s: float, what: str = "condition") -> T:
        return wait_for(condition, timeout_s, what)

    def nodes_in_state(self, state: str) -> list[str]:
        proc = self.run(["sinfo", "-h", "-N", "-t", state, "-o", "%N"], check=False, timeout_s=10)
        return sorted(set(proc.stdout.split())) if proc.returncode == 0 else []

    def ping(self) -> bool:
        """True if slurmctld answers."""
        try:
            proc = self.run(["scontrol", "ping"], check=False, timeout_s=10)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and "UP" in proc.stdout


def client_env(slurm_conf: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = str(slurm_conf)
    return env
