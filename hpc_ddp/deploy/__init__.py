"""Describe a job and run it, with one interface for every backend (docs/architecture.md).

``JobSpec`` (sbatch, submitit) and ``LaunchSpec`` (pdsh/clush) share one core, ``ProcessSpec``.
A backend's ``describe`` gives the script (``render`` is the sbatch one), its ``submit`` a ``Job``
to ask, wait for and cancel; ``hpc_ddp.submit`` / ``hpc_ddp.describe`` pick the backend.
Never imports torch: describing a job must take well under a second. The names below load on
first use, so that importing one small module of the package (``program``, which every command
imports to register its programs) does not pay for the templates and specs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpc_ddp.deploy.sbatch.render import render
    from hpc_ddp.deploy.spec import JobSpec, build_spec, load_spec_file

__all__ = ["JobSpec", "build_spec", "load_spec_file", "render"]

_LAZY = {
    "JobSpec": "hpc_ddp.deploy.spec",
    "build_spec": "hpc_ddp.deploy.spec",
    "load_spec_file": "hpc_ddp.deploy.spec",
    "render": "hpc_ddp.deploy.sbatch.render",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpc_ddp.deploy' has no attribute {name!r}")
