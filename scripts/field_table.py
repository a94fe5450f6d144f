"""The table of every job spec field in docs/job-spec.md, made from the fields' declarations.

A maintainer's tool of the source checkout: ``python scripts/field_table.py`` rewrites the table
(``--check``: only say whether it is stale). tests/test_spec_fields.py fails when it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from hpc_ddp.deploy.script_file import write_atomic
from hpc_ddp.deploy.spec import SLURM_FIELDS, JobSpec
from hpc_ddp.schema import default_of, field_types, literal_choices, range_of, type_name

DOC = Path(__file__).resolve().parents[1] / "docs" / "job-spec.md"
BEGIN = "<!-- field table: made by scripts/field_table.py from the fields' declarations -->\n"
END = "<!-- end of the field table -->\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def field_table() -> str:
    """The table, one row per field in the fields' order, between its two markers."""
    kinds = field_types(JobSpec)
    rows = [
        "| field | value | `#SBATCH` option, or where the script uses it | on submitit "
        "(local executor) | may hold | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in dataclasses.fields(JobSpec):
        s = SLURM_FIELDS[f.name]
        rng = range_of(f)
        choices = literal_choices(kinds[f.name])
        kind = f"one of {', '.join(choices)}" if choices else type_name(kinds[f.name])
        value = f"{kind}, default {default_of(f)!r}"
        where = "; ".join(x for x in (_code(s.sbatch), s.script) if x)
        if s.refused:
            submitit = f"refused unless default: {s.refused}"
        elif s.replaced:
            submitit = f"replaced: {s.replaced}"
        elif s.plain:
            submitit = _code(s.submitit) or f"additional parameter `{s.option}`"
        else:
            submitit = s.submitit
        if s.slurm_only:
            submitit += " (local: not used, said so)"
        holds = s.text or (rng.bounds() if rng else "")
        cells = [_code(f.name), value, where, submitit, holds, f.metadata.get("help", "")]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return BEGIN + "\n".join(rows) + "\n" + END


def section_of(text: str) -> str:
    """The table as the doc holds it (from its first marker to its last), "" if none."""
    start, end = text.find(BEGIN), text.find(END)
    return text[start : end + len(END)] if start >= 0 and end >= 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is stale")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    old, new = section_of(text), field_table()
    if not old:
        print(f"{DOC} has no field table markers", file=sys.stderr)
        return 1
    if old == new:
        print(f"{DOC}: up to date")
        return 0
    if args.check:
        print(f"{DOC}: stale", file=sys.stderr)
        return 1
    write_atomic(DOC, text.replace(old, new), force=True)
    print(f"{DOC}: rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
