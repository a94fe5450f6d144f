"""Optional parts of the install: the core (env, render, submit, launch, doctor) needs only
jinja2 and filelock; training needs ``hpc-ddp[train]``, submitit submission ``hpc-ddp[submitit]``,
the trainer's ``--metrics tensorboard`` ``hpc-ddp[tensorboard]``.
"""

from __future__ import annotations

import importlib.util

from hpc_ddp.errors import ConfigError

# extra -> the modules it provides, in the order they are checked
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("torch", "torchvision", "matplotlib"),
    "submitit": ("submitit",),
    "tensorboard": ("tensorboard",),  # the trainer's --metrics tensorboard
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (found without importing them)."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise a ConfigError naming the extra when ``what`` needs modules that are not installed."""
    absent = missing(extra)
    if absent:
        raise ConfigError(
            f"{what} needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} "
            "not installed",
            hint=f"pip install 'hpc-ddp[{extra}]' (scripts/install.sh installs every extra)",
        )
