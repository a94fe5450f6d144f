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

import getpass
import os
import re
import secrets
import shlex
import time
from dataclasses import dataclass, field

from hpc_ddp.cluster.port import derive_port
from hpc_ddp.deploy.hosts import canonical_hosts
from hpc_ddp.errors import ConfigError

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

# Exit codes of the host script itself (the payload's own codes pass through unchanged).
EXIT_WRONG_RANK = 97  # %n does not name the host the canonical order puts there
EXIT_NO_WORKDIR = 96
EXIT_SETUP_FAILED = 95

_H, _N = "\x00H", "\x00N"  # sentinels for %h / %n while the rest of the text gets escaped
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LAUNCH_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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
    gpus_per_process: int = 1
    mode: str = "torchrun"
    rcmd: str = "ssh"
    env: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = ()
    workdir: str = "."
    python: str = "python3"
    state_dir: str = "/tmp/hpc-ddp-launch"
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
        if self.gpus_per_node < 1 or self.gpus_per_process < 1:
            raise ConfigError(
                f"--gpus-per-node {self.gpus_per_node} / --gpus-per-process "
                f"{self.gpus_per_process}: both must be >= 1",
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
        if not _LAUNCH_ID.match(self.launch_id):
            raise ConfigError(
                f"launch id {self.launch_id!r} is not a plain name",
                hint="letters, digits, '.', '-', '_' (it names pid files on every host)",
            )
        for key, _ in self.env:
            if not _ENV_KEY.match(key):
                raise ConfigError(f"--env {key!r} is not a variable name", hint="use --env K=V")

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
        return f"{self.state_dir}/{self.launch_id}"


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
    python: str = "python3",
    workdir: str | None = None,
    state_dir: str | None = None,
    **kwargs: object,
) -> LaunchSpec:
    """Resolve the defaults the CLI leaves open, then build a validated LaunchSpec.

    - hosts: expanded and put in canonical (sorted) order; node rank 0 = the first.
    - master address: the first host; with ``rcmd=exec`` every "host" is this machine, whose
      made-up names (node0, node1) need not resolve, so it is 127.0.0.1.
    - master port: derived from the launch id (hpc_ddp.cluster.port), so two launches sharing
      a host pick different ports without talking to each other.
    - command: one that starts with an option is trainer arguments: ``python -m hpc_ddp.train``.
    """
    host_list = canonical_hosts(hosts)
    launch_id = launch_id or new_launch_id()
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
        state_dir=state_dir or f"/tmp/hpc-ddp-launch-{getpass.getuser()}",
        **kwargs,  # type: ignore[arg-type]
    )


# ----------------------------------------------------------------------------- host script


def _finish(lines: list[str]) -> str:
    """Join, double every literal '%', then turn the sentinels into pdsh/clush placeholders."""
    return "\n".join(lines).replace("%", "%%").replace(_H, "%h").replace(_N, "%n") + "\n"


def payload_argv(spec: LaunchSpec) -> list[str]:
    """What the host script starts in its own session: torchrun or the node agent."""
    if spec.mode == "torchrun":
        return [
            spec.python,
            "-m",
            "torch.distributed.run",  # == torchrun, but needs no console script on PATH
            f"--nnodes={spec.num_nodes}",
            f"--node-rank={_N}",
            f"--nproc-per-node={spec.nproc_per_node}",
            f"--master-addr={spec.master_addr}",
            f"--master-port={spec.master_port}",
            "--max-restarts=0",  # a failed rank fails the launch; restarts belong to requeue
            "--monitor-interval=0.5",
            # static rendezvous: how long a node waits for the master's store before giving up
            f"--rdzv-conf=timeout={spec.rendezvous_timeout_s}",
            "--no-python",
            *spec.command,
        ]
    return [
        spec.python,
        "-m",
        "hpc_ddp.deploy.node_agent",
        f"--nproc={spec.nproc_per_node}",
        f"--grace={spec.stop_grace_s}",
        "--",
        *spec.command,
    ]


def host_script(spec: LaunchSpec) -> str:
    """The bash text every host runs: check rank, cd, export, set up, start, record, wait."""
    q = shlex.quote
    launcher_env: list[tuple[str, str]] = [("HPC_DDP_LAUNCH_ID", spec.launch_id)]
    if spec.mode == "processes":
        # The contract of hpc_ddp.cluster.launcher; the node agent adds HPC_DDP_LOCAL_RANK.
        launcher_env += [
            ("HPC_DDP_LAUNCHER", spec.tool),
            ("HPC_DDP_JOB_ID", spec.launch_id),
            ("HPC_DDP_NUM_NODES", str(spec.num_nodes)),
            ("HPC_DDP_NODE_RANK", _N),
            ("HPC_DDP_LOCAL_WORLD_SIZE", str(spec.nproc_per_node)),
            ("HPC_DDP_MASTER_ADDR", spec.master_addr),
            ("HPC_DDP_MASTER_PORT", str(spec.master_port)),
        ]
    tag = "hpc-ddp-launch:"
    lines = [
        f"# hpc-ddp launch {spec.launch_id}: host script (node rank from the tool's %n)",
        f"host={_H}",
        f"node_rank={_N}",
        f"hosts=({' '.join(q(h) for h in spec.hosts)})",
        'if [ "${hosts[$node_rank]:-}" != "$host" ]; then',
        f'  echo "{tag} host $host got node rank $node_rank, but the launch order '
        f'{",".join(spec.hosts)} puts ${{hosts[$node_rank]:-no host}} there" >&2',
        f"  exit {EXIT_WRONG_RANK}",
        "fi",
        f'cd {q(spec.workdir)} || {{ echo "{tag} $host: cannot cd to" {q(spec.workdir)} >&2;'
        f" exit {EXIT_NO_WORKDIR}; }}",
    ]
    lines += [f"export {k}={q(v)}" for k, v in spec.env]
    for step in spec.setup:
        lines.append(
            f'{{ {step}\n}} || {{ echo "{tag} $host: setup step failed:" {q(step)} >&2;'
            f" exit {EXIT_SETUP_FAILED}; }}"
        )
    lines += [f"export {k}={q(v) if v != _N else v}" for k, v in launcher_env]
    pidfile = f'{q(spec.launch_dir)}/"$host".pgid'
    lines += [
        f"mkdir -p {q(spec.launch_dir)} || exit 1",
        # Own session: its process group id is its pid, recorded so `hpc-ddp launch stop`
        # (or the launcher, when another host fails) can end everything it started here.
        f"setsid {shlex.join(payload_argv(spec))} </dev/null &",
        "pid=$!",
        f'echo "$pid" > {pidfile}',
        "trap 'kill -TERM -- -$pid 2>/dev/null' TERM INT HUP",
        'wait "$pid"; rc=$?',
        # a trapped signal interrupts wait: keep waiting for the real exit code
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
        f"rm -f {pidfile}",
        f'echo "{tag} host=$host node_rank=$node_rank exit=$rc" >&2',
        "exit $rc",
    ]
    return _finish(lines)


def stop_script(spec: LaunchSpec) -> str:
    """Bash for every host: end the process group recorded for this launch, TERM then KILL.

    A pid file can outlive its launch (a host rebooted, a wrapper was killed). If the recorded
    leader still exists but was not started by this launch, its pid was reused: leave it alone.
    While any member of the old group lives, Linux does not reuse the group id, so killing
    ``-pgid`` cannot hit a stranger.
    """
    q = shlex.quote
    tag = "hpc-ddp-launch-stop:"
    pidfile = f'{q(spec.launch_dir)}/"$host".pgid'
    marker = q(f"HPC_DDP_LAUNCH_ID={spec.launch_id}")
    ticks = max(1, spec.stop_grace_s * 10)
    lines = [
        f"host={_H}",
        f'[ -f {pidfile} ] || {{ echo "{tag} $host: nothing running"; exit 0; }}',
        f"pg=$(cat {pidfile})",
        # Unreadable environ = the leader is gone; its group may live on, so go on and kill it.
        "if leader_env=$( { tr '\\0' '\\n' < \"/proc/$pg/environ\"; } 2>/dev/null ); then",
        f'  printf "%s\\n" "$leader_env" | grep -qxF {marker} || {{',
        f'    echo "{tag} $host: pid $pg is no longer this launch"; rm -f {pidfile}; exit 0; }}',
        "fi",
        f'kill -TERM -- "-$pg" 2>/dev/null || {{ rm -f {pidfile}; '
        f'echo "{tag} $host: already gone"; exit 0; }}',
        f"for _ in $(seq {ticks}); do",
        f'  kill -0 -- "-$pg" 2>/dev/null || {{ echo "{tag} $host: stopped"; exit 0; }}',
        "  sleep 0.1",
        "done",
        'kill -KILL -- "-$pg" 2>/dev/null',
        f'echo "{tag} $host: killed (still running {spec.stop_grace_s} s after SIGTERM)"',
    ]
    return _finish(lines)


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
