"""``ProcessSpec``: what every backend's spec shares. How many processes run where, and what each
of them runs, with the rules that hold whichever backend starts them.

``JobSpec`` (sbatch, submitit) and ``LaunchSpec`` (pdsh/clush) add their backend's fields on top.
Every problem is collected and reported at once: a user fixing a job file should not have to
discover its mistakes one submission at a time. A problem names the field the way its spec's
user wrote it (a key of the job file, a flag of ``hpc-ddp launch``): ``label`` says how.
Pure Python, never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpc_ddp import schema
from hpc_ddp.cluster.devices import resolve_gpus_per_process
from hpc_ddp.cluster.hostlist import MAX_HOSTS
from hpc_ddp.deploy.container import ContainerSpec
from hpc_ddp.deploy.program import ProgramHook
from hpc_ddp.deploy.program import program_hook as hook_of
from hpc_ddp.deploy.safe_text import ENV_NAME, control_problem
from hpc_ddp.env_vars import GPUS_PER_PROCESS_VAR
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.schema import field_doc

# The program a spec runs unless it names another: the project's trainer. Only its name: what
# deployment asks of it, its hook answers (hpc_ddp.deploy.program).
TRAIN_MODULE = "hpc_ddp.train"
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
NODES = schema.Range(1, MAX_HOSTS)
PER_NODE = schema.Range(0, schema.MAX_PER_NODE)


@dataclass(frozen=True, kw_only=True)
class ProcessSpec:
    """Nodes, GPUs and processes of a job; the environment, setup and program of each process."""

    nodes: int = field(default=1, metadata=field_doc("number of nodes", "-N", range=NODES))
    gpus_per_node: int = field(
        default=0,
        metadata=field_doc("GPUs per node; 0 = CPU job with Gloo", range=PER_NODE),
    )
    # None (0 in a file or flag) = not given: settled in core_problems by the one rule
    # (hpc_ddp.cluster.devices) from ``env``, the variables every process gets; an int after.
    gpus_per_process: int | None = field(
        default=None,
        metadata=field_doc(
            "GPUs each process drives: 1 = one process per GPU; 0 = not given: "
            f"{GPUS_PER_PROCESS_VAR} in env, else 1",
            range=PER_NODE,
        ),
    )
    procs_per_node: int = field(
        default=0,
        metadata=field_doc(
            "processes per node; 0 = derived (GPUs/GPUs per process, or 1 on CPU)",
            range=PER_NODE,
        ),
    )
    workdir: str = field(
        default="",
        metadata=field_doc("working directory; empty = where submitted", "--chdir", "-D"),
    )
    env: dict[str, str] = field(
        default_factory=dict, metadata=field_doc("environment for every process (KEY=VALUE)")
    )
    setup: list[str] = field(
        default_factory=list,
        metadata=field_doc("shell lines run first (module load, venv activation)"),
    )
    python: str = field(default="python", metadata=field_doc("Python interpreter of every process"))
    module: str = field(default=TRAIN_MODULE, metadata=field_doc("module to run (python -m)"))
    script: str = field(default="", metadata=field_doc("script to run instead of a module"))
    args: list[str] = field(default_factory=list, metadata=field_doc("arguments of the program"))
    container: ContainerSpec | None = field(
        default=None,
        metadata=field_doc("run every process in this image ([container] table; docs/layouts.md)"),
    )

    # --- derived layout ------------------------------------------------------------------
    @property
    def ppn(self) -> int:
        """Processes per node."""
        if self.procs_per_node:
            return self.procs_per_node
        return self.gpus_per_node // self.gpus_per_process if self.gpus_per_node else 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ppn

    @property
    def program(self) -> list[str]:
        """What follows the interpreter: ``-m module args`` or ``script args``."""
        head = [self.script] if self.script else ["-m", self.module] if self.module else []
        return [*head, *self.args]

    @property
    def argv(self) -> list[str]:
        """The whole command of one process. With neither module nor script, ``args`` is it."""
        return [self.python, *self.program] if self.module or self.script else list(self.args)

    @property
    def program_module(self) -> str | None:
        """The module each process runs (``python -m``); None for a script or a command."""
        return self.module if self.module and not self.script else None

    @property
    def program_hook(self) -> ProgramHook | None:
        """What answers for the program's arguments (the trainer's own parser, for the
        trainer); None for a program without a hook (hpc_ddp.deploy.program)."""
        module = self.program_module
        return hook_of(module) if module else None

    # --- rules -----------------------------------------------------------------------------
    def _adopt_container_table(self) -> None:
        """A ``container`` given as a table (a dict from Python, as a spec file's ``[container]``)
        becomes its ContainerSpec, keys checked as the file's are. Called first in
        ``__post_init__`` (object.__setattr__: the launch spec is frozen)."""
        if isinstance(self.container, Mapping):
            table = schema.from_mapping(ContainerSpec, self.container, source="container")
            object.__setattr__(self, "container", ContainerSpec(**table))

    def container_label(self, name: str) -> str:
        """How a problem names a field of the container table (the spec file's spelling)."""
        return f"container.{name}"

    def label(self, name: str, item: str | int | None = None) -> str:
        """How a problem names field ``name`` (``item``: a key of env, an index of a list)."""
        if item is None:
            return name
        if name == "env key":
            return f"env key {item!r}"
        return f"{name}[{item!r}]" if isinstance(item, str) else f"{name}[{item}]"

    def core_problems(self) -> list[str]:
        """Every broken rule of the shared fields; each message names the valid choices. The
        numbers are checked first (every field's declared Range, the backend's fields too); the
        layout's rules, which compute with them, only run on numbers in range."""
        numbers = schema.number_problems(self, self.label)
        p = numbers + ([] if numbers else self._layout_problems())
        if self.module and self.script:
            p.append("give at most one of module (python -m) and script")
        if self.module and not _MODULE.fullmatch(self.module):
            p.append(
                f"{self.label('module')} {self.module!r}: expected a dotted Python module name "
                "(hpc_ddp.train)"
            )
        if self.container is not None:
            p += self.container.problems(self.container_label)
        return p + self._text_problems()

    def _layout_problems(self) -> list[str]:
        """Nodes, GPUs and processes that contradict each other; settles gpus_per_process."""
        lab = self.label
        p: list[str] = []
        try:
            requested = schema.gpus_per_process_setting(
                self.gpus_per_process, lab("gpus_per_process")
            )
            gpp = resolve_gpus_per_process(requested, self.env)
        except HpcDdpError as err:
            gpp = 1  # lets the other checks run; the spec is refused
            p.append(err.message)
        object.__setattr__(self, "gpus_per_process", gpp)  # frozen: settled once, here
        g = self.gpus_per_node
        if g > 0 and gpp >= 1:
            if g % gpp:
                divisors = [d for d in range(1, g + 1) if g % d == 0]
                p.append(
                    f"{lab('gpus_per_node')} {g} is not a multiple of {lab('gpus_per_process')} "
                    f"{gpp}: every process drives the same number of GPUs; valid "
                    f"{lab('gpus_per_process')} for {g} GPUs: {divisors}"
                )
            elif self.procs_per_node and self.procs_per_node != g // gpp:
                p.append(
                    f"{lab('procs_per_node')}={self.procs_per_node} contradicts {g} GPUs per node "
                    f"at {gpp} per process ({g // gpp} processes); leave {lab('procs_per_node')} "
                    "at 0"
                )
        if g == 0 and gpp != 1:
            p.append(
                f"{lab('gpus_per_process')} only applies to GPU jobs: set "
                f"{lab('gpus_per_node')} or leave it at 1"
            )
        return p

    def _text_problems(self) -> list[str]:
        """Data never becomes code: a value the scripts shell-quote (python, script, args, env
        values, workdir) may hold anything but control characters (hpc_ddp.deploy.safe_text
        says why); setup lines are shell by design, one line each."""
        lab = self.label
        found = [
            control_problem(lab("python"), self.python),
            control_problem(lab("script"), self.script),
            control_problem(lab("workdir"), self.workdir),
        ]
        found += [control_problem(lab("args", i), arg) for i, arg in enumerate(self.args)]
        for key, value in self.env.items():
            if not ENV_NAME.fullmatch(key):
                found.append(f"{lab('env key', key)} is not a valid variable name")
            found.append(control_problem(lab("env", key), value))
        for i, line in enumerate(self.setup):
            if problem := control_problem(lab("setup", i), line, allow_tab=True):
                found.append(f"{problem} (give each shell line as its own setup entry)")
        return [problem for problem in found if problem]


def problem_list(problems: list[str]) -> str:
    """The problems as one indented list, each once, in the order found."""
    return "\n  - " + "\n  - ".join(dict.fromkeys(problems))
