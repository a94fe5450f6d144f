"""``hpc-ddp render``: a job description (spec file and/or flags) to an sbatch script.

Flags are generated from JobSpec's fields, so the schema lives in one place. Flags win over the
file. Every check runs before anything is written.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Any

from hpc_ddp import schema
from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.script_file import write_atomic
from hpc_ddp.deploy.spec import JobSpec, build_spec
from hpc_ddp.errors import ConfigError

_SKIP = {"args"}
_CHECKOUT = (
    Path(__file__).resolve().parents[2]
)  # the repository, when run from a source tree  # given after `--`


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per JobSpec field (only the flags given override the file)."""
    parser.add_argument("-c", "--config", metavar="FILE", help="job spec file (.toml or .json)")
    group = parser.add_argument_group("job spec fields (override the file)")
    schema.add_arguments(group, JobSpec, skip=_SKIP, show_defaults=False)
    parser.add_argument("args", nargs="*", help="program arguments (after --)")


def spec_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = schema.given_values(args, JobSpec)
    out.pop("args", None)
    if args.args:
        out["args"] = list(args.args)
    return out


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    if args.args and not args.config and args.args[0].endswith((".toml", ".json")):
        raise ConfigError(
            f"{args.args[0]!r} looks like a spec file but would become the program's arguments",
            hint=f"pass it as --config {args.args[0]} (program arguments go after --)",
        )
    return build_spec(args.config, spec_overrides(args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--script-out", metavar="FILE", help="write the script here (default: print it)"
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite an existing --script-out file"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    parser.add_argument(
        "--all-examples",
        action="store_true",
        help="re-render every jobs/specs/* into jobs/*.sbatch",
    )
    parser.add_argument(
        "--check", action="store_true", help="with --all-examples: only report stale renders"
    )
    parser.add_argument("--jobs-dir", type=Path, default=None, help=argparse.SUPPRESS)
    add_spec_arguments(parser)


def _recorded_command() -> str:
    if sys.argv[1:2] == ["render"]:
        return shlex.join(["hpc-ddp", *sys.argv[1:]])
    return "hpc-ddp render"


def run(args: argparse.Namespace) -> int:
    if args.all_examples:
        return _all_examples(args)
    spec = spec_from_args(args)
    text = render(spec, command=_recorded_command())
    if args.dry_run or not args.script_out:
        sys.stdout.write(text)
        return 0
    write_atomic(Path(args.script_out), text, force=args.force, mode=0o755)
    print(f"wrote {args.script_out} ({spec.layout}, {spec.world_text} processes)", file=sys.stderr)
    # Imported here: printing a script to stdout does not pay for it.
    from hpc_ddp.deploy.job_assumptions import of_spec, summary_lines

    summary = summary_lines(of_spec(spec))
    print("\n".join(summary).replace("THIS_FILE", args.script_out), file=sys.stderr)
    return 0


def _all_examples(args: argparse.Namespace) -> int:
    """Run the checkout's scripts/render_examples.py (a maintainer's tool, not in the wheel)."""
    tool = _CHECKOUT / "scripts" / "render_examples.py"
    if not ((_CHECKOUT / "pyproject.toml").is_file() and tool.is_file()):
        raise ConfigError(
            "--all-examples re-renders the committed jobs/ of a source checkout, and this "
            "hpc-ddp is an installed package",
            hint="run it in a clone of the hpc-ddp repository, with hpc-ddp installed from it "
            "(scripts/install.sh), or: python scripts/render_examples.py",
        )
    spec = importlib.util.spec_from_file_location("hpc_ddp_render_examples", tool)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    argv = ["--check"] if args.check or args.dry_run else []
    if args.jobs_dir:
        argv += ["--jobs-dir", str(args.jobs_dir)]
    return int(module.main(argv))
