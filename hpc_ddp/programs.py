"""The programs of this package that jobs run, plugged into the deployment layer by their hooks.

The deployment layer asks a job's program about its arguments through the program's hook
(hpc_ddp.deploy.program), found by the module's name among the entry points of the group
``hpc_ddp.programs``; pyproject.toml declares the trainer's. The layers above deploy that know the
trainer (the command line, the public API, ``hpc_ddp.Executor``) also register it here, so that
an install whose metadata predates that entry point (an editable install of an older checkout)
still checks the trainer's arguments instead of taking it for a program of the user's.
Registering imports nothing: a hook is loaded when a job that runs its program is looked at.
"""

from __future__ import annotations

from hpc_ddp.deploy import program

# module -> its hook, as pyproject.toml's [project.entry-points."hpc_ddp.programs"] declares it
# (tests/test_program_hook.py checks that the two agree).
HOOKS = {"hpc_ddp.train": "hpc_ddp.train.program_hook:HOOK"}


def register() -> None:
    """Register this package's programs; a hook registered before for one of them stays."""
    for module, hook in HOOKS.items():
        program.register(module, hook, replace=False)
