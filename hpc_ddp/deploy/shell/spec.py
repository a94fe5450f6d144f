"""Scheduler-less launch: the pdsh/clush command lines that start one job on every host.

Layers, each quoted exactly once by the shell that will parse it:

1. the *host script*: bash text run once per host. ``%h``/``%n`` (host, node rank) are the only
   placeholders; every other ``%`` is doubled, because pdsh and clush both substitute ``%``.
2. the *host argv*: ``bash -c SCRIPT``.
3. the *tool argv*: pdsh or clush with their flags, then layer 2 as the tool needs it: pdsh's
   exec worker runs an argv (no shell); pdsh's ssh module and clush join it into one string that
   a shell parses, so they get ``shlex.join(host argv)``.

Why ``clush -R exec ... ssh %h`` instead of clush's ssh worker: that worker does not substitute
``%n`` (pdsh's ssh module does), so the node rank would be lost. The exec worker substitutes both,
and running ``ssh`` from it keeps every ssh option visible in ``--dry-run``.

This module builds and renders; ``launch_runner`` runs. Neither imports torch.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field

from hpc_ddp.cluster.devices import gpus_per_process_setting, resolve_gpus_per_process
from hpc_ddp.cluster.host_names import is_host_name
from hpc_ddp.cluster.master_port import derive_port
from hpc_ddp.deploy.safe_text import ENV_NAME, control_problem
from hpc_ddp.deploy.shell.host_order import canonical_hosts, check_address
from hpc_ddp.deploy.shell.host_scripts import host_script, stop_script
from hpc_ddp.errors import ConfigError, LaunchEnvError

TOOLS = ("pdsh", "clush")
MODES = ("torchrun", "processes")
RCMDS = ("ssh", "exec")

# Never prompt (a prompt on one of 64 hosts is a hang), fail a dead host in seconds, no X11.
SSH_OPTIONS = ("-oBatchMode=yes", "-oConnectTimeout=10", "-oForwardX11=no")
# Local variables a trainer needs that a remote shell would not have: forwarded unless --env
# overrides them or --no-forward-env is given. CUDA_VISIBLE_DEVICES is deliberately absent: the
# launcher's own GPUs say nothing about another host's.
FORWARD_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
FORWARD_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_CPP_LOG_LEVEL")

_LAUNCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch: no trailing newline
_STATE_DIR = re.compile(r"/[^\x00-\x1f\x7f]*")
DEFAULT_STATE_DIR_SHOWN = "${XDG_RUNTIME_DIR:-~/.local/state}/hpc-ddp/launch"


def new_launch_id() -> str:
    """Sortable and unique enough to name a launch, its pid files and its derived port."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def forwarded_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The local variables that must be exported on the remote side (see FORWARD_*)."""
    return {
        k: v
        for k, v in sorted(environ.items())
        if k in FORWARD_NAMES or k.startswith(FORWARD_PREFIXES)
    }


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a scheduler-less launch needs; validated at construction."""

    tool: str
    hosts: tuple[str, ...]  # canonical (sorted, de-duplicated) order: index = node rank
    command: tuple[str, ...]  # what each training process runs
    master_addr: str
    master_port: int
    launch_id: str
    gpus_per_node: int = 1
    # None (0 from the flag) = not given: settled at construction by the one rule
    # (hpc_ddp.cluster.devices) from ``env``, the variables every process gets; an int after.
    gpus_per_process: int | None = None
    mode: str = "torchrun"
    rcmd: str = "ssh"
    env: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = ()
    workdir: str = "."
    # The interpreter running hpc-ddp: on the shared file system that --workdir already assumes,
    # the same path (venv included) exists on every host, so no --setup is needed to find torch.
    python: str = field(default_factory=lambda: sys.executable)
    # Where each host keeps the launch's pid files; "" = the host's private state dir
    # (host_scripts resolves it there: hpc_ddp.private_paths' rules).
    state_dir: str = ""
    timeout_s: int | None = None  # pdsh/clush -u: last-resort bound on the whole run per host
    rendezvous_timeout_s: int = 120
    stop_grace_s: int = 10
    tool_path: str | None = None
    ssh_options: tuple[str, ...] = field(default=SSH_OPTIONS)

    def __post_init__(self) -> None:
        for name, value, valid in (
            ("tool", self.tool, TOOLS),
            ("mode", self.mode, MODES),
            ("rcmd", self.rcmd, RCMDS),
        ):
            if value not in valid:
                raise ConfigError(
                    f"{name} {value!r} is not supported", hint=f"valid: {', '.join(valid)}"
                )
        if not self.hosts:
            raise ConfigError("no hosts to launch on", hint="pass --hosts 'node[01-02]'")
        if not self.command:
            raise ConfigError(
                "no command to run after '--'",
                hint="e.g. hpc-ddp launch pdsh --hosts 'n[1-2]' -- --epochs 1  (trainer args) or"
                " -- python3 my_worker.py",
            )
        requested = gpus_per_process_setting(self.gpus_per_process, "--gpus-per-process")
        try:
            gpp = resolve_gpus_per_process(requested, dict(self.env))
        except LaunchEnvError as err:  # a bad flag or --env value: settings, not a launch
            raise ConfigError(err.message, hint=err.hint) from None
        object.__setattr__(self, "gpus_per_process", gpp)  # frozen: settled once, here
        if self.gpus_per_node < 1:
            raise ConfigError(
                f"--gpus-per-node {self.gpus_per_node}: must be >= 1",
                hint="on CPU-only hosts --gpus-per-node counts process slots per host",
            )
        if self.gpus_per_node % self.gpus_per_process:
            raise ConfigError(
                f"--gpus-per-node {self.gpus_per_node} is not a multiple of --gpus-per-process "
                f"{self.gpus_per_process}",
                hint="every process drives the same number of GPUs; pick a divisor",
            )
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"master port {self.master_port} is not a TCP port", hint="1..65535")
        if not _LAUNCH_ID.fullmatch(self.launch_id):
            raise ConfigError(
                f"--launch-id {self.launch_id!r} is not a plain name",
                hint="letters, digits, '.', '-', '_' (it names pid files on every host)",
            )
        if self.state_dir and not _STATE_DIR.fullmatch(self.state_dir):
            raise ConfigError(
                f"--state-dir {self.state_dir!r} is not an absolute path without control "
                "characters",
                hint="pass an absolute directory only you can write, or leave --state-dir out",
            )
        for key, _ in self.env:
            if not ENV_NAME.fullmatch(key):
                raise ConfigError(f"--env {key!r} is not a variable name", hint="use --env K=V")
        bad_hosts = [h for h in self.hosts if not is_host_name(h)]
        if bad_hosts:
            raise ConfigError(
                f"host name(s) {bad_hosts[:5]} cannot be passed through ssh and pdsh/clush safely",
                hint="use plain host names (letters, digits, '.', '-', '_'), as in /etc/hosts",
            )
        check_address("--master-addr", self.master_addr)
        problems = self._text_problems()
        if problems:
            raise ConfigError(
                "launch values with control characters:\n  - " + "\n  - ".join(problems),
                hint="values are data: no line breaks or other control characters (variables "
                "forwarded from this shell count too; --no-forward-env skips them)",
            )

    def _text_problems(self) -> list[str]:
        """Free-text values are shell-quoted where they land; like every data field they may
        still hold no control character (hpc_ddp.deploy.safe_text says why)."""
        found = [control_problem(f"env {key}", value) for key, value in self.env]
        found += [control_problem(f"command argument {i}", a) for i, a in enumerate(self.command)]
        for i, line in enumerate(self.setup):  # shell by design, but one line per entry
            found.append(control_problem(f"--setup[{i}]", line, allow_tab=True))
        for flag, value in (
            ("--workdir", self.workdir),
            ("--python", self.python),
            ("--state-dir", self.state_dir),
            ("--tool-path", self.tool_path or ""),
            *(("ssh option", option) for option in self.ssh_options),
        ):
            found.append(control_problem(flag, value))
        return [problem for problem in found if problem]

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def nproc_per_node(self) -> int:
        return self.gpus_per_node // self.gpus_per_process

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    @property
    def tool_exe(self) -> str:
        return self.tool_path or self.tool

    @property
    def launch_dir(self) -> str:
        """For people: where the pid files go (the host resolves the default itself)."""
        return f"{self.state_dir or DEFAULT_STATE_DIR_SHOWN}/{self.launch_id}"


def make_spec(
    *,
    tool: str,
    hosts: str,
    command: list[str],
    rcmd: str = "ssh",
    master_addr: str | None = None,
    master_port: int | None = None,
    launch_id: str | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    workdir: str | None = None,
    state_dir: str | None = None,
    **kwargs: object,
) -> LaunchSpec:
    """Resolve the defaults the CLI leaves open, then build a validated LaunchSpec.

    - hosts: expanded and put in canonical (sorted) order; node rank 0 = the first.
    - master address: the first host; with ``rcmd=exec`` every "host" is this machine, whose
      made-up names (node0, node1) need not resolve, so it is 127.0.0.1.
    - master port: derived from the launch id (hpc_ddp.cluster.master_port), so two launches sharing
      a host pick different ports without talking to each other.
    - command: one that starts with an option is trainer arguments: ``python -m hpc_ddp.train``.
    """
    host_list = canonical_hosts(hosts)
    launch_id = launch_id or new_launch_id()
    python = python or sys.executable
    if master_addr is None:
        master_addr = "127.0.0.1" if rcmd == "exec" else host_list[0]
    port = master_port if master_port is not None else derive_port(launch_id)
    if command and command[0].startswith("-"):
        command = [python, "-m", "hpc_ddp.train", *command]
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does; N processes share the cores
    return LaunchSpec(
        tool=tool,
        hosts=tuple(host_list),
        command=tuple(command),
        rcmd=rcmd,
        master_addr=master_addr,
        master_port=port,
        launch_id=launch_id,
        env=tuple(sorted(env.items())),
        python=python,
        workdir=workdir or os.getcwd(),
        state_dir=os.path.abspath(state_dir) if state_dir else "",
        **kwargs,  # type: ignore[arg-type]
    )


# ----------------------------------------------------------------------------- tool argv


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
