"""``ShellBackend``: a LaunchSpec through pdsh or clush, on hosts without a scheduler.

describe: the standalone launch script (what ``hpc-ddp launch --render-script`` writes), with
the one command line ``--dry-run`` prints. submit: that command, watched by ``ShellJob``
(runner.py), which stops every host at the first failure.
"""

from __future__ import annotations

from typing import IO

from hpc_ddp.deploy.backend import Backend, DryRun
from hpc_ddp.deploy.shell.runner import ShellJob
from hpc_ddp.deploy.shell.script import render_launch_script
from hpc_ddp.deploy.shell.spec import LaunchSpec
from hpc_ddp.deploy.shell.tool_argv import launch_command
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.paths import RunPaths

DEFAULT_PRODUCER = "hpc_ddp.submit"


class ShellBackend(Backend):
    """pdsh or clush (the spec's ``tool``); the tool's output goes to ``stdout``/``stderr``
    (None: dropped)."""

    executor = "shell"  # the job's own executor is its tool: pdsh or clush

    def __init__(
        self,
        *,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        produced_by: str = DEFAULT_PRODUCER,
        script_name: str = "launch.sh",
    ) -> None:
        self.stdout, self.stderr = stdout, stderr
        self.produced_by = produced_by  # both recorded in the launch script's comments
        self.script_name = script_name

    def describe(self, spec: LaunchSpec) -> DryRun:
        text = render_launch_script(
            spec, produced_by=self.produced_by, script_name=self.script_name
        )
        command = launch_command(spec).shell()
        return DryRun(spec.tool, text, command, spec, _run_paths(spec), spec.program_module)

    def submit(self, plan: DryRun) -> ShellJob:
        return ShellJob(
            plan.request, stdout=self.stdout, stderr=self.stderr, run_paths=plan.run_paths
        )


def _run_paths(spec: LaunchSpec) -> RunPaths | None:
    """The run dir of a program with a hook (the trainer's), on the file system the hosts
    share, relative to their workdir. None if a ``--config`` file of the program's is not
    readable here: it may exist only on the hosts, and the program there names any problem."""
    hook = spec.program_hook
    if hook is None:
        return None
    try:
        return hook.run_paths(spec.args, spec.workdir)
    except ConfigError:
        return None
