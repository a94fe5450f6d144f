"""``ContainerSpec``: run every process of a job inside a container image.

Two runtimes, the ones HPC sites run training in:

- ``pyxis`` (enroot): a SPANK plugin of srun. ``srun --container-image=IMG ...`` puts each task
  in the container; only srun can do it, so the scheduler-less launch refuses it.
- ``apptainer`` (Singularity): a command, ``apptainer exec [--nv] IMG CMD...``, placed in front
  of the process's command wherever it runs.

Both pass the host's environment into the container by default (the launch variables, SLURM_*,
MASTER_ADDR reach the trainer). ``env`` names variables whose host value must win over one the
image defines. The batch shell stays on the host, so Slurm commands (``scontrol``) keep working
there even where the image has none. Pure Python, never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from hpc_ddp.deploy.safe_text import ENV_NAME, control_problem
from hpc_ddp.schema import field_doc

Runtime = Literal["pyxis", "apptainer"]
RUNTIMES: tuple[Runtime, ...] = get_args(Runtime)

# An image: a registry reference (docker://..., nvcr.io#nvidia/pytorch:24.05-py3, oras://...)
# or a file (.sif, .sqsh). No spaces or commas, and never an option: fullmatch, ASCII only.
_IMAGE = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_./:#@+=-]*", re.ASCII)
# One mount, SRC[:DST[:ro|rw]]: both runtimes split a mount list at ',' and each mount at ':'.
_PATH = r"/[^,:\s]*"
_MOUNT = re.compile(rf"{_PATH}(:{_PATH}(:(ro|rw))?)?")


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """The ``[container]`` table of a job spec (flags: ``--container-image`` and so on)."""

    runtime: Runtime = field(
        default="apptainer",
        metadata=field_doc(f"container runtime: {' or '.join(RUNTIMES)} (pyxis is srun only)"),
    )
    image: str = field(
        default="",
        metadata=field_doc(
            "image: a .sif/.sqsh file or a reference such as docker://pytorch/pytorch"
        ),
    )
    mounts: list[str] = field(
        default_factory=list,
        metadata=field_doc("host paths to mount, SRC[:DST[:ro]] each (absolute paths)"),
    )
    workdir: str = field(
        default="", metadata=field_doc("working directory inside; empty = the runtime's default")
    )
    env: list[str] = field(
        default_factory=list,
        metadata=field_doc("host variables whose value wins over the image's (names only)"),
    )

    def problems(self, label: Callable[[str], str] = "container.{}".format) -> list[str]:
        """Every problem, each naming its field by ``label(name)``: ``container.image`` in a spec
        file, ``--container-image`` on the command line."""
        p: list[str] = []
        if self.runtime not in RUNTIMES:
            p.append(f"{label('runtime')} {self.runtime!r} is not one of {', '.join(RUNTIMES)}")
        if problem := control_problem(label("image"), self.image):
            p.append(problem)
        elif not _IMAGE.fullmatch(self.image):
            p.append(
                f"{label('image')} {self.image!r}: expected an image file or reference such as "
                "'docker://pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime' or '/images/train.sif' "
                "(no spaces or commas, not starting with '-')"
            )
        for i, mount in enumerate(self.mounts):
            if problem := control_problem(f"{label('mounts')}[{i}]", mount):
                p.append(problem)
            elif not _MOUNT.fullmatch(mount):
                p.append(
                    f"{label('mounts')}[{i}] {mount!r}: expected SRC[:DST[:ro|rw]] with absolute "
                    "paths and no spaces or commas, e.g. '/scratch/data:/data:ro'"
                )
        if problem := control_problem(label("workdir"), self.workdir):
            p.append(problem)
        elif self.workdir and not re.fullmatch(_PATH, self.workdir):
            p.append(
                f"{label('workdir')} {self.workdir!r}: expected an absolute path inside the "
                "container, without spaces, commas or ':'"
            )
        for i, name in enumerate(self.env):
            if not ENV_NAME.fullmatch(name):
                p.append(f"{label('env')}[{i}] {name!r} is not a variable name (names only)")
        return p


def pyxis_srun_options(c: ContainerSpec) -> list[str]:
    """The srun options that put each task of a step in the container (pyxis's spelling)."""
    argv = [f"--container-image={c.image}"]
    if c.mounts:
        argv.append("--container-mounts=" + ",".join(c.mounts))
    if c.workdir:
        argv.append(f"--container-workdir={c.workdir}")
    if c.env:
        argv.append("--container-env=" + ",".join(c.env))
    return argv


def apptainer_exec_argv(c: ContainerSpec, *, gpus: bool) -> list[str]:
    """``apptainer exec [--nv] [--bind M]... [--pwd W] IMAGE``: the words in front of a
    process's command. ``--nv`` binds the host's NVIDIA driver and devices."""
    argv = ["apptainer", "exec"]
    if gpus:
        argv.append("--nv")
    for mount in c.mounts:
        argv += ["--bind", mount]
    if c.workdir:
        argv += ["--pwd", c.workdir]
    return [*argv, c.image]


def apptainer_env_lines(c: ContainerSpec) -> list[str]:
    """Bash for the host shell: apptainer gives ``APPTAINERENV_NAME``'s value to ``NAME`` inside,
    over the image's own. A name unset on the host stays unset. (Names match ENV_NAME, so they
    are plain words to the shell.)"""
    return [f'[ -z "${{{n}+set}}" ] || export APPTAINERENV_{n}="${{{n}}}"' for n in c.env]
