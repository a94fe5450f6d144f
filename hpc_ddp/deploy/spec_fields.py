"""How each field of a ``JobSpec`` reaches Slurm, declared once, as data on the field.

A field's ``Slurm`` entry (``slurm=`` in its metadata, ``hpc_ddp.schema.field_doc``) says which
``#SBATCH`` option it becomes, which submitit parameter (or that submitit replaces or refuses
it), whether the local executor ignores it, and what its text may hold (a class of
``hpc_ddp.deploy.safe_text``). The spec's checks, the sbatch renderer, the submitit mapping, the
docs' field table and the tests iterate over these entries instead of keeping lists of names.

A plain option (``plain=True``) needs nothing else: the renderer writes ``--OPTION=VALUE`` (a
switch: ``--OPTION``) when it is set, submitit gets it as an additional parameter (or as the
parameter ``submitit`` names), and the local executor says it does not use it. Pure data;
torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.deploy.safe_text import DIRECTIVE
from hpc_ddp.schema import field_doc


@dataclass(frozen=True)
class Slurm:
    """Where one JobSpec field goes on each executor. The texts are shown in the docs' table."""

    # The #SBATCH option it becomes, "" for none (then ``script`` says where the script uses it).
    sbatch: str = ""
    # True: written as --OPTION=VALUE (--OPTION for a switch) when set, by the renderer's loop and
    # submitit's additional parameters; False: the renderer and submitit compute it (``sbatch`` and
    # ``submitit`` then describe what they write).
    plain: bool = False
    # Where the batch script's body uses it (the step's command, its environment...).
    script: str = ""
    # submitit's parameter: for a plain option, the parameter it is passed as ("" = an additional
    # parameter named after the option); otherwise how submitit gets it.
    submitit: str = ""
    # submitit replaces it with its own mechanism: why (``describe`` says so when it is set).
    replaced: str = ""
    # submitit cannot honour any value but the default: why (the refusal names the field).
    refused: str = ""
    # Means nothing without Slurm: the local executor ignores it and says so.
    slurm_only: bool = False
    # What its text may hold (hpc_ddp.deploy.safe_text.TEXT_CLASSES); "" for numbers, switches
    # and tables with their own rules.
    text: str = ""

    @property
    def option(self) -> str:
        """The option's name as submitit's additional parameters key it (``mail-type``)."""
        return self.sbatch.removeprefix("--")


def sbatch_option(option: str, help: str, *, default: Any = "", submitit: str = "") -> Any:
    """A plain #SBATCH option as a JobSpec field, in one line: a text value (an #SBATCH value,
    checked as one) or, with ``default=False``, a switch."""
    text = "" if isinstance(default, bool) else DIRECTIVE
    slurm = Slurm(sbatch=option, plain=True, submitit=submitit, slurm_only=True, text=text)
    return field(default=default, metadata=field_doc(f"{help} (sbatch {option})", slurm=slurm))
