"""The one Jinja2 setup for every template (sbatch scripts, launch scripts).

The templates live in the repository's top-level ``templates/`` and ship inside the wheel as the
package ``hpc_ddp._templates`` (pyproject.toml maps the folder), so an installed hpc-ddp renders
from any directory. Set TEMPLATES_VAR (hpc_ddp.env_vars) to render from another directory (a
site's own).
"""

from __future__ import annotations

import os
import shlex
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2

from hpc_ddp.deploy.safe_text import comment_text
from hpc_ddp.env_vars import TEMPLATES_VAR
from hpc_ddp.errors import ConfigError

if TYPE_CHECKING:  # importlib.resources.abc is Python 3.11+; the package claims 3.10
    from importlib.resources.abc import Traversable

# Run from a source checkout (editable install, or PYTHONPATH=checkout), the checkout's own
# templates are the truth: another copy's hpc_ddp._templates may be importable beside it.
_CHECKOUT = Path(__file__).resolve().parents[2]


def template_root() -> Traversable:
    """Where templates are read from: $TEMPLATES_VAR, a checkout's, the installed package's."""
    override = os.environ.get(TEMPLATES_VAR)
    if override:
        if not Path(override).is_dir():
            raise ConfigError(
                f"{TEMPLATES_VAR}={override} is not a directory",
                hint=f"unset {TEMPLATES_VAR} to use the templates shipped with hpc-ddp",
            )
        return Path(override)
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "templates").is_dir():
        return _CHECKOUT / "templates"
    try:
        return resources.files("hpc_ddp._templates")
    except ModuleNotFoundError:
        raise ConfigError(
            "hpc-ddp's job templates are missing from this installation",
            hint="reinstall hpc-ddp (pip install hpc-ddp); a wheel built without its "
            "templates cannot render jobs",
        ) from None


def _load(root: Traversable, name: str) -> str | None:
    entry = root.joinpath(name)
    return entry.read_text(encoding="utf-8") if entry.is_file() else None


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    root = template_root()
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: _load(root, name)),
        undefined=jinja2.StrictUndefined,  # a typo in a template fails instead of printing ""
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # shell, not HTML: quoting is done with shlex
    )
    env.filters["shquote"] = shlex.quote
    env.filters["comment"] = comment_text  # free text inside a '#' line stays on that line
    return env


def get_template(name: str) -> jinja2.Template:
    return environment().get_template(name)
