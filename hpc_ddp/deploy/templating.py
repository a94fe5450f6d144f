"""The one Jinja2 setup for every template in ``templates/`` (sbatch scripts, launch scripts).

Set HPC_DDP_TEMPLATES to render from another directory (a site's own templates).
"""

from __future__ import annotations

import os
import shlex
from functools import lru_cache
from pathlib import Path

import jinja2

from hpc_ddp.deploy.safe_text import comment_text

TEMPLATE_DIR = Path(
    os.environ.get("HPC_DDP_TEMPLATES", Path(__file__).resolve().parents[2] / "templates")
)


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
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
