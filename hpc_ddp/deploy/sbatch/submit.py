"""Submit a rendered script with real sbatch, follow its log, wait for it.

Waiting reads ``scontrol show job`` (works without accounting, as on the local cluster); a
requeued job goes back to PENDING and is followed through its restart. What a script's
``#SBATCH`` lines say about its log is read here; everything about Slurm's commands and what
they print is hpc_ddp.slurm_client's. Never imports torch.
"""

from __future__ import annotations

import codecs
import re
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hpc_ddp import regular_file
from hpc_ddp.deploy.backend import Finished
from hpc_ddp.deploy.safe_text import comment_text
from hpc_ddp.deploy.submission_env import submission_env
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.polling import poll_until
from hpc_ddp.schema import read_text_file
from hpc_ddp.slurm_client import (
    TERMINAL,
    UNKNOWN,
    LostJobWatch,
    SlurmClient,
    restarts,
    shell_exit_code,
)

_OUTPUT = re.compile(r"^#SBATCH\s+(?:--output|-o)[= ]\s*(\S+)", re.M)
_JOBNAME = re.compile(r"^#SBATCH\s+(?:--job-name|-J)[= ]\s*(\S+)", re.M)
_CHDIR = re.compile(r"^#SBATCH\s+(?:--chdir|-D)[= ]\s*(\S+)", re.M)


@dataclass(frozen=True)
class Submitted:
    job_id: str
    output: Path | None  # the batch log, once %j/%x are known


def _expand(pattern: str, job_id: str, name: str) -> str:
    return pattern.replace("%j", job_id).replace("%x", name).replace("%%", "%")


def script_workdir(text: str, cwd: Path) -> Path:
    """Where the job of ``text`` runs: its ``#SBATCH --chdir``, else the submission directory."""
    chdir = _CHDIR.search(text)
    return cwd / shlex.split(chdir.group(1))[0] if chdir else cwd


def script_output(text: str, job_id: str, cwd: Path) -> Path:
    """Where the batch log of ``text`` goes once it has an id."""
    out = _OUTPUT.search(text)
    name_m = _JOBNAME.search(text)
    base = script_workdir(text, cwd)
    if out is None:
        return base / f"slurm-{job_id}.out"
    name = shlex.split(name_m.group(1))[0] if name_m else "sbatch"
    return base / _expand(shlex.split(out.group(1))[0], job_id, name)


def prepare_output_dir(text: str, cwd: Path) -> None:
    """Slurm does not create the log's directory; a missing one makes the job fail silently."""
    out = _OUTPUT.search(text)
    if out is None:
        return
    pattern = shlex.split(out.group(1))[0]
    parent = Path(pattern).parent
    if "%" not in str(parent):
        (script_workdir(text, cwd) / parent).mkdir(parents=True, exist_ok=True)


def sbatch(
    script: Path,
    cluster_env: Mapping[str, str],
    *,
    cwd: Path,
    extra_args: tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> Submitted:
    """Real sbatch with a scrubbed environment (no SLURM_* of an enclosing job, SLURM_CONF kept)."""
    text = read_text_file(script, what="batch script")
    prepare_output_dir(text, cwd)
    env = submission_env(environ)
    env.update(cluster_env)
    job_id = SlurmClient(env).submit(script.resolve(), *extra_args, cwd=cwd)
    return Submitted(job_id, script_output(text, job_id, cwd))


class LogFollower:
    """Prints what is appended to a file (the job log), from where it stood last time.

    Whole lines, so that a line being written is printed once it is complete; read in chunks
    of at most ``CHUNK`` bytes (a line longer than that is printed in pieces), so memory stays
    the same whatever the log's size. Only a regular file is read (``regular_file``): a FIFO
    at the log's name would block the read, a link to /dev/zero never end it. Such a file is
    refused once, kept in ``refused`` (and said in the sink if ``say_refusal``), never read.
    """

    CHUNK = 1 << 20

    def __init__(self, path: Path | None, sink: TextIO | None, *, say_refusal: bool = True):
        self.path, self.sink, self.pos = path, sink, 0
        self.say_refusal = say_refusal
        self.refused: OSError | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def poll(self, *, final: bool = False) -> None:
        """Write what was appended since the last poll; ``final``: the log is complete, a last
        line without a line break included."""
        if self.sink is None or self.path is None or self.refused is not None:
            return
        try:
            f = regular_file.open_regular(self.path, follow_symlinks=True)
        except FileNotFoundError:
            return  # not written yet
        except OSError as err:
            self.refused = err
            if self.say_refusal:
                self.sink.write(f"hpc-ddp: not following {self.refusal()}\n")
            return
        with f:
            while True:
                f.seek(self.pos)
                chunk = f.read(self.CHUNK)
                end = chunk.rfind(b"\n") + 1
                full = len(chunk) == self.CHUNK
                if (full and not end) or (final and not full):
                    end = len(chunk)  # a line longer than a chunk, or the log's last line
                if not end:
                    break
                self.sink.write(self._decoder.decode(chunk[:end], final=False))
                self.pos += end
        if final:
            self.sink.write(self._decoder.decode(b"", final=True))
        self.sink.flush()

    def refusal(self) -> str:
        """``path: why`` of a refused log."""
        why = self.refused.strerror if self.refused is not None else None
        return comment_text(f"{self.path}: {why or self.refused}")


def wait_job(
    job_id: str,
    cluster_env: Mapping[str, str],
    *,
    timeout_s: float | None,
    output: Path | None = None,
    follow: TextIO | None = None,
    on_poll: Callable[[dict[str, str]], None] | None = None,
) -> Finished:
    """Until the job is in a terminal state (requeues are followed); cancel it at the deadline
    (None: no deadline)."""
    client = SlurmClient({**submission_env(), **cluster_env})
    follower = LogFollower(output, follow)
    info: dict[str, str] = {}
    lost = LostJobWatch(job_id)

    def ended() -> bool:
        nonlocal info
        info = client.job_info(job_id)
        follower.poll()
        if on_poll is not None:
            on_poll(info)
        if info.get("JobState") in TERMINAL:
            return True
        lost.answer(info.get("JobState", UNKNOWN))
        return False

    if not poll_until(ended, timeout_s, interval_s=0.2):
        client.cancel(job_id)
        raise HpcDdpError(
            f"job {job_id} still {info.get('JobState')} after {timeout_s:.0f} s: cancelled it",
            hint="raise submit --wait-timeout, or look at the job log",
        )
    time.sleep(0.1)
    follower.poll(final=True)
    return Finished(job_id, info["JobState"], shell_exit_code(info), restarts(info), output)
