"""The pdsh/clush command lines that run one script on every host of a launch.

Layers, each quoted exactly once by the shell that will parse it:

1. the *host script* (``host_scripts``): bash text run once per host. ``%h``/``%n`` (host, node
   rank) are the only placeholders; every other ``%`` is doubled, because pdsh and clush both
   substitute ``%``.
2. the *host argv*: ``bash -c SCRIPT``.
3. the *tool argv*: pdsh or clush with their flags, then layer 2 as the tool needs it: pdsh's
   exec worker runs an argv (no shell); pdsh's ssh module and clush join it into one string that
   a shell parses, so they get ``shlex.join(host argv)``.

Why ``clush -R exec ... ssh %h`` instead of clush's ssh worker: that worker does not substitute
``%n`` (pdsh's ssh module does), so the node rank would be lost. The exec worker substitutes both,
and running ``ssh`` from it keeps every ssh option visible in ``--dry-run``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from hpc_ddp.deploy.shell.host_scripts import host_script, stop_script
from hpc_ddp.deploy.shell.spec import LaunchSpec


@dataclass(frozen=True)
class ToolCommand:
    """An argv plus the variables the *local* tool process needs (pdsh's ssh arguments)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        """The exact command, pasteable into a shell."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return f"{prefix} {shlex.join(self.argv)}" if prefix else shlex.join(self.argv)


def tool_command(spec: LaunchSpec, script: str, *, timeout_s: int | None = None) -> ToolCommand:
    """pdsh/clush argv that runs ``bash -c script`` once on every host, in canonical order."""
    hosts = ",".join(spec.hosts)
    host_argv = ["bash", "-c", script]
    # Fanout below the host count would start the last hosts only after the first ones finish:
    # a distributed job would wait forever for them. So fanout >= number of hosts, always.
    fanout = str(max(spec.num_nodes, 32))
    if spec.tool == "pdsh":
        argv = [spec.tool_exe, "-S", "-R", spec.rcmd, "-f", fanout, "-w", hosts]
        if timeout_s:
            argv += ["-u", str(timeout_s)]
        if spec.rcmd == "exec":
            return ToolCommand((*argv, *host_argv))
        # pdsh's ssh module joins the command into one string for the remote shell.
        ssh_env = (("PDSH_SSH_ARGS_APPEND", " ".join(spec.ssh_options)),)
        return ToolCommand((*argv, shlex.join(host_argv)), ssh_env)
    argv = [spec.tool_exe, "-R", "exec", "-f", fanout, "-w", hosts, "--maxrc", "--nostdin"]
    if timeout_s:
        argv += ["-u", str(timeout_s)]
    remote = shlex.join(host_argv)
    if spec.rcmd == "ssh":  # see the module docstring: clush's ssh worker drops %n
        remote = shlex.join(["ssh", *spec.ssh_options, "%h", remote])
    return ToolCommand((*argv, remote))


def launch_command(spec: LaunchSpec) -> ToolCommand:
    return tool_command(spec, host_script(spec), timeout_s=spec.timeout_s)


def stop_command(spec: LaunchSpec) -> ToolCommand:
    # Bounded: a stop must never be what hangs. Grace + ssh connect + slack.
    return tool_command(spec, stop_script(spec), timeout_s=spec.stop_grace_s + 30)
