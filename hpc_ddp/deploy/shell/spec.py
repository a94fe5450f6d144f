"""``LaunchSpec``: one scheduler-less launch (pdsh/clush), validated at construction.

The shared core (GPUs and processes per host, env, setup, workdir, program) and its rules are
``hpc_ddp.deploy.core.ProcessSpec``; a launch adds its hosts (one node each, in canonical order),
the tool and remote command, the rendezvous address, and how it is stopped. Problems name the
``hpc-ddp launch`` flags. ``make_spec`` resolves the defaults the CLI leaves open.

How the spec becomes command lines: ``host_scripts`` (the bash each host runs) and ``tool_argv``
(the pdsh/clush argv around it). This module imports neither. Never imports torch.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from hpc_ddp import schema
from hpc_ddp.cluster.host_names import is_host_name
from hpc_ddp.cluster.master_port import derive_port
from hpc_ddp.deploy.core import NODES, TRAIN_MODULE, ProcessSpec, problem_list
from hpc_ddp.deploy.safe_text import control_problem
from hpc_ddp.deploy.shell.host_order import canonical_hosts, check_address
from hpc_ddp.errors import ConfigError
from hpc_ddp.schema import field_doc

Tool = Literal["pdsh", "clush"]
TOOLS: tuple[Tool, ...] = get_args(Tool)
# torchrun: one torchrun per host; processes: the project's node agent starts them itself.
Mode = Literal["torchrun", "processes"]
MODES: tuple[Mode, ...] = get_args(Mode)
# ssh: real hosts; exec: every "host" is this machine (pdsh's/clush's exec worker).
Rcmd = Literal["ssh", "exec"]
RCMDS: tuple[Rcmd, ...] = get_args(Rcmd)

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
_COMMAND_HINT = (
    "e.g. hpc-ddp launch pdsh --hosts 'n[1-2]' -- --epochs 1  (trainer args) or"
    " -- python3 my_worker.py"
)


def new_launch_id() -> str:
    """Sortable and unique enough to name a launch, its pid files and its derived port."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The local variables that must be exported on the remote side (see FORWARD_*)."""
    return {
        k: v
        for k, v in sorted(environ.items())
        if k in FORWARD_NAMES or k.startswith(FORWARD_PREFIXES)
    }


@dataclass(frozen=True, kw_only=True)
class LaunchSpec(ProcessSpec):
    """Everything a scheduler-less launch needs. One node per host: ``nodes`` = len(hosts).

    ``gpus_per_node`` counts process slots on CPU-only hosts. With neither ``module`` nor
    ``script``, ``args`` is the whole command each process runs (``command``).
    """

    tool: Tool
    hosts: tuple[str, ...]  # canonical (sorted, de-duplicated) order: index = node rank
    master_addr: str
    master_port: int = field(metadata=field_doc("rendezvous TCP port", range=schema.PORT))
    launch_id: str
    # 0: derived from hosts
    nodes: int = field(default=0, metadata=field_doc("one node per host", range=NODES))
    gpus_per_node: int = field(
        default=1,
        metadata=field_doc(
            "GPUs per host (process slots on CPU-only hosts)",
            range=schema.Range(
                1, schema.MAX_PER_NODE, why="on CPU-only hosts it counts process slots"
            ),
        ),
    )
    module: str = ""
    # The interpreter running hpc-ddp: on the shared file system that --workdir already assumes,
    # the same path (venv included) exists on every host, so no --setup is needed to find torch.
    python: str = field(default_factory=lambda: sys.executable)
    workdir: str = field(default_factory=os.getcwd)  # where the launch starts, on every host
    mode: Mode = "torchrun"
    rcmd: Rcmd = "ssh"
    # Where each host keeps the launch's pid files; "" = the host's private state dir
    # (host_scripts resolves it there: hpc_ddp.private_paths' rules).
    state_dir: str = ""
    timeout_s: int | None = field(
        default=None,
        metadata=field_doc(
            "pdsh/clush -u: last-resort bound on the whole run per host",
            range=schema.Range(1, schema.YEAR_S),
            flag="--timeout",
        ),
    )
    rendezvous_timeout_s: int = field(
        default=120,
        metadata=field_doc(
            "seconds a node waits for the master's store",
            range=schema.Range(1, 86_400),
            flag="--rendezvous-timeout",
        ),
    )
    stop_grace_s: int = field(
        default=10,
        metadata=field_doc(
            "SIGTERM -> SIGKILL seconds", range=schema.Range(0, 3600), flag="--stop-grace"
        ),
    )
    tool_path: str | None = None
    ssh_options: tuple[str, ...] = SSH_OPTIONS

    def __post_init__(self) -> None:
        self._adopt_container_table()
        if not self.nodes:
            object.__setattr__(self, "nodes", len(self.hosts))  # frozen: set once, here
        problems = self.core_problems() + self._launch_problems()
        if problems:
            raise ConfigError(
                "invalid launch:" + problem_list(problems),
                hint="fix the values above (`hpc-ddp launch --help` lists every flag); values "
                "are data: no line breaks or other control characters, and that holds for the "
                "variables forwarded from this shell too (--no-forward-env skips them)",
            )

    def label(self, name: str, item: str | int | None = None) -> str:
        """Problems name the ``hpc-ddp launch`` flag (``--gpus-per-node``, ``--env K``)."""
        if name == "args" and isinstance(item, int):  # its index in the whole command
            return f"command argument {item + len(self.argv) - len(self.args)}"
        if name == "env":
            return f"env {item}"
        if name == "env key":
            return f"--env {item!r}"
        flag = _FLAGS.get(name) or "--" + name.replace("_", "-")
        return flag if item is None else f"{flag}[{item}]"

    def container_label(self, name: str) -> str:
        return f"--container-{name}"

    def _launch_problems(self) -> list[str]:
        p: list[str] = []
        for name, value, valid in (
            ("tool", self.tool, TOOLS),
            ("mode", self.mode, MODES),
            ("rcmd", self.rcmd, RCMDS),
        ):
            if value not in valid:
                p.append(f"{name} {value!r} is not supported; valid: {', '.join(valid)}")
        if self.container is not None and self.container.runtime != "apptainer":
            p.append(
                f"--container-runtime {self.container.runtime!r}: pyxis is a plugin of srun and "
                "cannot start processes without Slurm; use --container-runtime apptainer here, "
                "or submit the job with `hpc-ddp submit` for pyxis"
            )
        if not self.hosts:
            p.append("no hosts to launch on: pass --hosts 'node[01-02]'")
        elif self.nodes != len(self.hosts):
            p.append(f"nodes={self.nodes} but {len(self.hosts)} host(s): one node per host")
        if not self.argv:
            p.append(f"no command to run after '--' ({_COMMAND_HINT})")
        if not _LAUNCH_ID.fullmatch(self.launch_id):
            p.append(
                f"--launch-id {self.launch_id!r} is not a plain name: letters, digits, '.', '-',"
                " '_' (it names pid files on every host)"
            )
        if self.state_dir and not _STATE_DIR.fullmatch(self.state_dir):
            p.append(
                f"--state-dir {self.state_dir!r} is not an absolute path without control "
                "characters: pass an absolute directory only you can write, or leave it out"
            )
        bad_hosts = [h for h in self.hosts if not is_host_name(h)]
        if bad_hosts:
            p.append(
                f"host name(s) {bad_hosts[:5]} cannot be passed through ssh and pdsh/clush "
                "safely: use plain host names (letters, digits, '.', '-', '_')"
            )
        try:
            check_address("--master-addr", self.master_addr)
        except ConfigError as err:
            p.append(f"{err.message}: {err.hint}")
        p += [control_problem("--state-dir", self.state_dir)]
        p += [control_problem("--tool-path", self.tool_path or "")]
        p += [control_problem("ssh option", option) for option in self.ssh_options]
        return [problem for problem in p if problem]

    @property
    def command(self) -> tuple[str, ...]:
        """What each training process runs (after torchrun's ``--no-python`` / the node agent)."""
        return tuple(self.argv)

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def nproc_per_node(self) -> int:
        return self.ppn

    @property
    def tool_exe(self) -> str:
        return self.tool_path or self.tool

    @property
    def launch_dir(self) -> str:
        """For people: where the pid files go (the host resolves the default itself)."""
        return f"{self.state_dir or DEFAULT_STATE_DIR_SHOWN}/{self.launch_id}"


# Each field's flag of `hpc-ddp launch` (--timeout is timeout_s), as problems name them.
_FLAGS = {f.name: schema.flag_of(f) for f in fields(LaunchSpec)}


def make_spec(
    *,
    tool: str,
    hosts: str,
    command: list[str],
    rcmd: str = "ssh",
    master_addr: str | None = None,
    master_port: int | None = None,
    launch_id: str | None = None,
    env: Mapping[str, str] | None = None,
    forward_env: bool = True,
    setup: list[str] | tuple[str, ...] = (),
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
    - python: this interpreter, or with a container the image's ``python``.
    - env: ``forward_env`` puts this process's NCCL_*, GLOO_*, PYTHONPATH... (forwarded_env)
      under ``env``, as ``hpc-ddp launch`` does unless ``--no-forward-env``.
    """
    host_list = canonical_hosts(hosts)
    launch_id = launch_id or new_launch_id()
    # In an image the launching machine's interpreter path means nothing: the image's python.
    python = python or ("python" if kwargs.get("container") else sys.executable)
    if master_addr is None:
        master_addr = "127.0.0.1" if rcmd == "exec" else host_list[0]
    port = master_port if master_port is not None else derive_port(launch_id)
    trainer = bool(command) and command[0].startswith("-")
    env = {**(forwarded_env(os.environ) if forward_env else {}), **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does; N processes share the cores
    return LaunchSpec(
        tool=tool,  # type: ignore[arg-type]  # checked by LaunchSpec, with every other value
        hosts=tuple(host_list),
        module=TRAIN_MODULE if trainer else "",
        args=list(command),
        setup=list(setup),
        rcmd=rcmd,  # type: ignore[arg-type]
        master_addr=master_addr,
        master_port=port,
        launch_id=launch_id,
        env=dict(sorted(env.items())),
        python=python,
        workdir=workdir or os.getcwd(),
        state_dir=os.path.abspath(state_dir) if state_dir else "",
        **kwargs,  # type: ignore[arg-type]
    )
