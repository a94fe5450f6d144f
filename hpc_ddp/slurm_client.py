"""A thin client for one Slurm cluster: which Slurm answers here, sbatch, scancel, job states,
waiting with deadlines.

The one module that knows Slurm's client commands and what they print (``sbatch --parsable``,
``scontrol show job -o``, ``ExitCode=CODE:SIGNAL``, the terminal job states). The deploy layer
and the embedded cluster (hpc_ddp.localslurm) both use it; it imports neither.

:func:`reachable_slurm` asks the tools on PATH which Slurm they reach (the embedded cluster's
chooser and ``hpc-ddp doctor`` both go by its answer). No accounting runs on the local cluster
(no sacct), so a job's end is read from ``scontrol show job`` while slurmctld keeps it
(MinJobAge). Polling that is faster than ``sbatch --wait``, which backs off to multi-second
sleeps.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.env_vars import SLURM_VAR
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.polling import wait_for

# The JobState this module reports for a job slurmctld does not answer about (forgotten, or
# the controller gone).
UNKNOWN = "UNKNOWN"
# What hpc-ddp reports for a job that has ended with an outcome it did not read (a local
# submitit job whose result pickle someone else could have written); no Slurm state.
ENDED = "ENDED"

# A job id as Slurm prints it (an array task's: 12_3).
_JOB_ID = re.compile(r"[0-9]{1,12}(_[0-9]{1,9})?", re.ASCII)
# Slurm counts a job's restarts in 16 bits.
MAX_RESTARTS = 0xFFFF
# States after which a job never runs again (a requeued job goes back to PENDING instead).
TERMINAL = frozenset(
    {
        ENDED,
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


SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
# `scontrol ping` answers in milliseconds, also when the controller is down or no Slurm is
# configured at all; the bound is for a resolver that does not answer (see PROBE_RES_OPTIONS).
PROBE_TIMEOUT_S = 10.0
# With no config file, the tools look for a configless site's DNS SRV record. glibc waits
# 5 s x 2 tries per query on a resolver that does not answer; a working one answers in ms.
PROBE_RES_OPTIONS = "timeout:2 attempts:1"
# What the tools print when they found no config file and no configless server.
NO_CONFIG = "Could not establish a configuration source"


@dataclass(frozen=True)
class SlurmTarget:
    """Where submissions go: ``env`` for the Slurm clients, ``description`` for people."""

    env: dict[str, str]
    description: str
    local_root: Path | None = None  # the embedded cluster's dir, when the toolkit's own


def _ask(argv: list[str], env: Mapping[str, str]) -> tuple[bool, str]:
    """(answered, text): text is stdout when it answered, else the last line of stderr."""
    resolver = f"{env.get('RES_OPTIONS', '')} {PROBE_RES_OPTIONS}".strip()
    probe_env = {**env, "RES_OPTIONS": resolver}
    try:
        proc = subprocess.run(
            argv, env=probe_env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return True, proc.stdout
    said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return False, said[-1] if said else f"exit {proc.returncode}"


def _describe(scontrol: str, ping: str, env: Mapping[str, str], origin: str) -> str:
    controller = re.search(r" at (\S+) is UP", ping)
    ok, config = _ask([scontrol, "show", "config"], env)
    name = re.search(r"^ClusterName\s*=\s*(\S+)", config, re.M) if ok else None
    return (
        f"the Slurm cluster {name.group(1) if name else '(unnamed)'!r}, controller "
        f"{controller.group(1) if controller else '?'} ({origin})"
    )


def reachable_slurm(environ: Mapping[str, str] | None = None) -> SlurmTarget | None:
    """The Slurm this machine's tools reach, asked through the tools themselves; None if none.

    Found however the site set it up: SLURM_CONF, the tools' compiled-in slurm.conf (under
    /etc/slurm, /opt/slurm/etc, ...: whatever ``scontrol`` on PATH reads), a configless
    site (DNS SRV records, slurmd's cached config). A Slurm that is configured but does not
    answer is an error, not a reason to look elsewhere: jobs meant for the user's cluster must
    never silently run somewhere else.
    """
    env = dict(os.environ if environ is None else environ)
    conf_var = env.get("SLURM_CONF")
    hint = (
        f"start that cluster, or unset SLURM_CONF / set {SLURM_VAR}=local to use the "
        "toolkit's embedded local cluster instead"
    )
    if conf_var and not Path(conf_var).is_file():  # the tools would retry it for a minute
        raise ConfigError(f"SLURM_CONF names {conf_var}, which does not exist", hint=hint)
    configured = f"SLURM_CONF={conf_var}" if conf_var else None
    if configured is None and SYSTEM_CONF.exists():
        configured = str(SYSTEM_CONF)
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        if configured:
            raise ConfigError(
                f"Slurm is configured ({configured}) but scontrol is not installed",
                hint="apt-get install slurm-client (or load the site's Slurm module)",
            )
        return None
    origin = configured or f"found by {scontrol}"
    answered, text = _ask([scontrol, "ping"], env)
    if answered:
        client_env = {"SLURM_CONF": conf_var} if conf_var else {}
        return SlurmTarget(client_env, _describe(scontrol, text, env, origin))
    if NO_CONFIG in text and not conf_var:
        return None  # the tools are installed, but no config file and no configless server
    raise HpcDdpError(f"the Slurm configured by {origin} does not answer: {text}", hint=hint)


class SlurmTimeoutError(HpcDdpError):
    """A Slurm command that got no answer in time (``SlurmClient.run``'s timeout)."""


class LostJobWatch:
    """Tells a controller that missed an answer from a job Slurm no longer knows, for the loops
    that wait on a job: a busy slurmctld can miss one ``scontrol show job``, but a job unknown
    for ``grace_s`` is gone (the controller died, or the job ended and aged out of its memory),
    and a wait without a deadline must not poll it for ever."""

    def __init__(self, job_id: str, grace_s: float = 15.0) -> None:
        self.job_id = job_id
        self.grace_s = grace_s
        self._unknown_since: float | None = None

    def answer(self, state: str) -> None:
        """Record one poll's JobState; raise HpcDdpError once it has been UNKNOWN too long."""
        if state != UNKNOWN:
            self._unknown_since = None
        elif self._unknown_since is None:
            self._unknown_since = time.monotonic()
        elif time.monotonic() - self._unknown_since > self.grace_s:
            raise HpcDdpError(
                f"Slurm no longer knows job {self.job_id} (no answer about it for "
                f"{self.grace_s:.0f} s)",
                hint="scontrol ping says whether the controller runs; squeue/sacct -j "
                f"{self.job_id} say how the job ended",
            )


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


def slurm_job_to_requeue(environ: Mapping[str, str]) -> str | None:
    """The id ``scontrol requeue`` needs: ``ARRAYJOB_TASK`` for an array task, else the job id."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def is_job_id(text: str) -> bool:
    """Whether ``text`` names one job. Never 0: Slurm's tools read job 0 as every job
    (``scontrol show job 0`` lists them all)."""
    return bool(_JOB_ID.fullmatch(text)) and int(text.partition("_")[0]) != 0


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
        try:
            proc = subprocess.run(
                list(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd
            )
        except subprocess.TimeoutExpired:
            raise SlurmTimeoutError(
                f"`{' '.join(argv)}` got no answer from Slurm in {timeout_s:.0f} s",
                hint="`scontrol ping` says whether slurmctld is up; an overloaded one answers "
                "late, a stopped one never",
            ) from None
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
        return self.job_info(job_id).get("JobState", UNKNOWN)

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

    def nodes_in_state(self, state: str) -> list[str]:
        proc = self.run(["sinfo", "-h", "-N", "-t", state, "-o", "%N"], check=False, timeout_s=10)
        return sorted(set(proc.stdout.split())) if proc.returncode == 0 else []

    def ping(self) -> bool:
        """True if slurmctld answers."""
        try:
            proc = self.run(["scontrol", "ping"], check=False, timeout_s=10)
        except SlurmTimeoutError:
            return False
        return proc.returncode == 0 and "UP" in proc.stdout


def client_env(slurm_conf: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = str(slurm_conf)
    return env
