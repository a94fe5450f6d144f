"""Render a scheduler-less launch as a plain bash script a user can keep (``--render-script``).

The script carries the very argv ``hpc-ddp launch`` would run (built by ``tool_argv``, quoted
once with ``shlex``), a ``stop`` action, and the same fail-fast watch as ``runner``: at the
first failed host it stops every host. It needs bash, pdsh or clush, nothing from hpc-ddp.
"""

from __future__ import annotations

from hpc_ddp import __version__
from hpc_ddp.deploy.shell.spec import LaunchSpec
from hpc_ddp.deploy.shell.tool_argv import launch_command, stop_command
from hpc_ddp.deploy.templating import get_template

TEMPLATES = {"pdsh": "pdsh_launch.sh.j2", "clush": "clush_launch.sh.j2"}


def render_launch_script(
    spec: LaunchSpec, *, produced_by: str = "hpc-ddp launch", script_name: str = "launch.sh"
) -> str:
    """The script's text. ``produced_by`` and ``script_name`` are recorded in comments."""
    launch, stop = launch_command(spec), stop_command(spec)
    template = get_template(TEMPLATES[spec.tool])
    banner = (
        f"hpc-ddp launch {spec.launch_id}: {','.join(spec.hosts)} x {spec.nproc_per_node} "
        f"({spec.mode}), master {spec.master_addr}:{spec.master_port}"
    )
    return template.render(
        spec=spec,
        version=__version__,
        produced_by=produced_by,
        script_name=script_name,
        banner=banner,
        launch_env=list(launch.env),
        launch_argv=list(launch.argv),
        stop_argv=list(stop.argv),
    )
