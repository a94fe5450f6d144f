"""Helpers for trainer tests, local and (later) under Slurm: build argv, wait, signal, read results.

Everything here drives real processes; nothing is mocked. Waits poll a condition (the run's
progress.json) with a deadline instead of sleeping and hoping.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from cli_forkserver import ForkedCli, ForkedProcess

VENV_BIN = Path(sys.executable).parent
HPC_DDP = str(VENV_BIN / "hpc-ddp")
TORCHRUN = str(VENV_BIN / "torchrun")

# Small enough that a 2-process run takes seconds on 2 cores, large enough for several steps.
SMALL = {
    "synthetic": True,
    "synthetic_train_size": 256,
    "synthetic_test_size": 101,  # odd: not divisible by 2 ranks (exact evaluation)
    "epochs": 2,
    "batch_size": 16,
    "log_every": 100,
    "model": "lenet",
    # No plot helper (a process that imports matplotlib) beside runs that never look at
    # plot.png: the few that do ask for it (plot=True).
    "plot": False,
}


def train_args(run_dir: Path, data_dir: Path, **overrides: Any) -> list[str]:
    """Flags for ``hpc-ddp train`` / ``python -m hpc_ddp.train`` from SMALL + overrides."""
    settings = {**SMALL, "run_dir": str(run_dir), "data_dir": str(data_dir), **overrides}
    argv: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def job_env(**extra: str) -> dict[str, str]:
    """The test process's environment minus launcher variables it may have inherited."""
    drop = ("SLURM_", "SLURMD_", "TORCHELASTIC_", "SUBMITIT_", "OMPI_", "PMI_", "PMIX_", "HPC_DDP_")
    names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in names}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, args: list[str], script: str | None = None) -> list[str]:
    """torchrun starting ``python -m hpc_ddp.train args``, or ``script args``."""
    entry = [script] if script else ["-m", "hpc_ddp.train"]
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *entry, *args]


Proc = subprocess.Popen[str] | ForkedProcess  # what ``start`` returns


class ForkedCmd(list[str]):
    """A command that ``run`` and ``start`` hand to the fork server (``fork_server``) as
    ``argv``: an `hpc-ddp` command's, or with ``script`` a script's (on ``ranks`` ranks if
    given); ``subprocess`` itself runs the list as a fresh process."""

    def __init__(
        self, cmd: list[str], argv: list[str], *, script: bool = False, ranks: int | None = None
    ) -> None:
        super().__init__(cmd)
        self.argv, self.script, self.ranks = argv, script, ranks


def python_cmd(script: str, args: list[str]) -> list[str]:
    """``python script args``, forked from ``fork_server`` by ``run`` and ``start``: for a
    script that wraps the trainer (tests/workers/), where the interpreter's start is not what
    is tested."""
    return ForkedCmd([sys.executable, script, *args], [script, *args], script=True)


def forked_script(nproc: int, script: str, args: list[str]) -> list[str]:
    """``script args`` on ``nproc`` ranks, as ``torchrun --standalone --nproc-per-node nproc``
    starts it (torch's env:// variables, one CPU thread each), its ranks forked by hpc_ddp.spawn
    in a child of ``fork_server``: for the runs that only provide a script's weights to compare
    against, where torchrun would start three interpreters that import torch. Shown (and run
    outside ``run``/``start``) as ``hpc-ddp exec --nproc-per-node``, its fresh-process twin."""
    exec_cmd = [HPC_DDP, "exec", "--nproc-per-node", str(nproc), "--", sys.executable]
    return ForkedCmd([*exec_cmd, script, *args], [script, *args], script=True, ranks=nproc)


def single_cmd(args: list[str]) -> list[str]:
    """``hpc-ddp train args``: one process, forked from ``fork_server`` by ``run`` and
    ``start`` (``subprocess`` itself starts it as a fresh interpreter)."""
    return ForkedCmd([HPC_DDP, "train", *args], ["train", *args])


def forked_cmd(nproc: int, args: list[str]) -> list[str]:
    """``hpc-ddp train --nproc-per-node nproc args``: the workers forked from one interpreter
    (tests/test_spawn.py checks that they end bit for bit where torchrun's do). ``run`` and
    ``start`` fork that interpreter in turn from ``fork_server``, which imported torch once:
    the runs that need N ranks but do not test a launcher start no interpreter at all. A
    fraction of the CPU time of a torchrun run on a small machine."""
    argv = ["train", "--nproc-per-node", str(nproc), *args]
    return ForkedCmd([HPC_DDP, *argv], argv)


@cache
def fork_server() -> ForkedCli:
    """`hpc-ddp` commands forked from one process of this test process that imported what
    `train` imports first (cli_forkserver.py); it ends, and removes its scratch dir, when this
    process exits."""
    scratch = Path(tempfile.mkdtemp(prefix="hpcddp-forked-"))
    preload = ["torch", "hpc_ddp.dist", "hpc_ddp.commands.train"]
    cli = ForkedCli(preload, job_env(), scratch)
    atexit.register(cli.close)
    return cli


def spawn_ranks(function: Callable[..., object], args: tuple[object, ...], nprocs: int) -> None:
    """``torch.multiprocessing.spawn(function, args, nprocs)`` (``function(rank, *args)`` on
    each rank; an AssertionError with the ranks' output if one failed), the ranks forked from
    ``fork_server`` instead of started as fresh interpreters that import torch and the test
    module. ``args``: what JSON carries (numbers, strings, booleans)."""
    log = scratch_file("ranks-")
    call = (function.__module__, function.__qualname__, list(args))
    proc = fork_server().start([f"{function.__module__}.{function.__qualname__}"], log,
                               call=call, ranks=nprocs, env=job_env())  # fmt: skip
    try:
        code = proc.wait(timeout=300)
    finally:
        proc.kill()  # only if the wait failed: it has a code otherwise
    assert code == 0, f"a rank of {function.__qualname__} failed (exit {code}):\n{log.read_text()}"


def scratch_file(prefix: str) -> Path:
    """A new empty file in the fork server's scratch dir (removed when the server ends)."""
    fd, name = tempfile.mkstemp(prefix=prefix, dir=fork_server().scratch)
    os.close(fd)
    return Path(name)


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    if isinstance(cmd, ForkedCmd):
        server = fork_server()
        return server.run(
            cmd.argv, timeout=timeout, env=job_env(), script=cmd.script, ranks=cmd.ranks
        )
    return subprocess.run(
        cmd, env=job_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def reference_run(run_dir: Path, data_dir: Path, *, timeout: float = 120, **overrides: Any) -> Path:
    """An uninterrupted 2-rank run of SMALL (with ``overrides``), forked: what interrupted runs
    must end equal to. Fails the test unless it exits 0."""
    done = run(forked_cmd(2, train_args(run_dir, data_dir, **overrides)), timeout=timeout)
    assert done.returncode == 0, done.stderr
    return run_dir


def start(cmd: list[str], log: Path) -> Proc:
    """``cmd`` with its stdout and stderr into ``log``."""
    if isinstance(cmd, ForkedCmd):
        return fork_server().start(cmd.argv, log, env=job_env(), script=cmd.script, ranks=cmd.ranks)
    handle = log.open("w")
    return subprocess.Popen(cmd, env=job_env(), stdout=handle, stderr=subprocess.STDOUT, text=True)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def read_result(run_dir: Path) -> dict[str, Any]:
    return read_json(Path(run_dir) / "result.json")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_resumed_like(
    run_dir: Path, ref_dir: Path, *, interruptions: int, steps: int
) -> dict[str, Any]:
    """An interrupted run ended as the uninterrupted ``ref_dir`` did: as many steps, bit-identical
    weights, the same training-loss curve. Returns the run's result for further checks."""
    result, reference = read_result(run_dir), read_result(ref_dir)
    assert result["interruptions"] == interruptions
    assert result["steps"] == reference["steps"] == steps
    assert result["params_sha256"] == reference["params_sha256"]
    assert [r["train_loss"] for r in read_metrics(run_dir)] == [
        r["train_loss"] for r in read_metrics(ref_dir)
    ]
    return result


def wait_for_progress(
    run_dir: Path,
    ready: Callable[[dict[str, Any]], bool],
    proc: Proc,
    timeout: float = 90,
) -> dict[str, Any]:
    """Poll progress.json until ``ready(progress)``; fail early if the job exits first."""
    path = Path(run_dir) / "progress.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            progress = read_json(path)  # written atomically (rename)
            if ready(progress):
                return progress
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before progress was ready")
        time.sleep(0.05)
    raise AssertionError(f"progress in {run_dir} not ready within {timeout} s")


def wait_for_checkpoint(run_dir: Path, step: int, proc: Proc, timeout: float = 60) -> None:
    """Until checkpoints/latest names step ``step`` (a background save commits after its step
    has passed); fail early if the job exits first."""
    latest, wanted = Path(run_dir) / "checkpoints" / "latest", f"step-{step:08d}\n"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if latest.exists() and latest.read_text() == wanted:
            return
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before step {step} committed")
        time.sleep(0.05)
    raise AssertionError(f"step {step}'s checkpoint in {run_dir} not committed within {timeout} s")


def holding(progress: dict[str, Any]) -> bool:
    return progress.get("status") == "holding"


def signal_workers(progress: dict[str, Any], sig: signal.Signals) -> None:
    """Send ``sig`` to every rank's process (their pids are in progress.json)."""
    for pid in progress["pids"]:
        os.kill(pid, sig)


def finish(proc: Proc, log: Path, timeout: float = 120) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"job did not exit within {timeout} s:\n{log.read_text()}") from None
    return rc, log.read_text()


def interrupt_at(
    cmd: list[str],
    run_dir: Path,
    log: Path,
    sig: signal.Signals = signal.SIGUSR1,
    *,
    launcher: bool = False,
) -> tuple[int, str]:
    """Run ``cmd`` (which must pass --debug-hold-at-step N) and signal it at step N: every
    rank's process, or with ``launcher`` only the process started (torchrun forwards SIGTERM
    to its workers, as it does when Slurm signals ``srun torchrun``)."""
    proc = start(cmd, log)
    try:
        progress = wait_for_progress(run_dir, holding, proc)
        if launcher:
            proc.send_signal(sig)
        else:
            signal_workers(progress, sig)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return finish(proc, log)
