"""``MODULE:FUNCTION``: a user's model or dataset named on the command line or in a config file.

Parsed and validated here without importing anything (config validation, the finished-run
answer and the deploy layer stay torch-free and never run a user's code); ``plugins.py``
imports it where training happens. MODULE is a dotted module name importable from the working
directory or PYTHONPATH, or a path to a ``.py`` file; FUNCTION is a name in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpc_ddp.errors import ConfigError

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(?:\.{_IDENT})*")
_FUNCTION = re.compile(_IDENT)
# A path: printable characters, no control characters, ending in .py.
_PY_PATH = re.compile(r"[^\x00-\x1f\x7f]+\.py")

CONTRACTS = {
    "model": "FUNCTION(num_classes: int) returning a torch.nn.Module",
    "dataset": 'FUNCTION(split) with split "train" or "test", returning a map-style dataset of '
    "(input tensor, label) pairs with a `classes` sequence attribute, each label an int, a "
    "numpy integer or a 0-d integer tensor below len(classes)",
}


@dataclass(frozen=True)
class PluginSpec:
    module: str  # a dotted name or a .py path
    function: str

    @property
    def is_path(self) -> bool:
        return self.module.endswith(".py")

    def __str__(self) -> str:
        return f"{self.module}:{self.function}"


def looks_like_plugin(value: str) -> bool:
    return ":" in value


def parse(kind: str, value: str) -> PluginSpec:
    """``MODULE:FUNCTION`` -> PluginSpec, or ConfigError naming the accepted forms."""
    module, _, function = value.rpartition(":")
    ok = bool(_FUNCTION.fullmatch(function)) and (
        bool(_DOTTED.fullmatch(module)) or bool(_PY_PATH.fullmatch(module))
    )
    if not ok:
        raise ConfigError(
            f"{kind}={value!r} is not a registered {kind} nor MODULE:FUNCTION",
            hint=f"MODULE is a dotted module name (importable from the working directory or "
            f"PYTHONPATH) or a path to a .py file, FUNCTION a name in it: {CONTRACTS[kind]}",
        )
    return PluginSpec(module, function)
