"""The committed jobs: ``jobs/specs/<name>.toml`` renders to ``jobs/<name>.sbatch``.

A maintainer's tool of the source checkout, not of the installed package: run
``python scripts/render_examples.py [--check]`` or ``hpc-ddp render --all-examples``, which
loads this file from the checkout. tests/test_jobs_up_to_date.py fails when a
template or a default changed and the committed renders were not regenerated.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.script_file import write_atomic
from hpc_ddp.deploy.spec import build_spec

REPO = Path(__file__).resolve().parents[1]
JOBS_DIR = REPO / "jobs"


@dataclass(frozen=True)
class Example:
    spec_path: Path
    script_path: Path

    @property
    def command(self) -> str:
        """The header line: relative paths, so the bytes do not depend on the checkout's place."""
        rel = self.spec_path.relative_to(self.spec_path.parents[2])
        out = self.script_path.relative_to(self.script_path.parents[1])
        return (
            f"hpc-ddp render --config {rel} --script-out {out} (or: hpc-ddp render --all-examples)"
        )

    def render(self) -> str:
        return render(build_spec(self.spec_path), command=self.command)


def examples(jobs_dir: Path = JOBS_DIR) -> list[Example]:
    specs = sorted((jobs_dir / "specs").glob("*.toml")) + sorted(
        (jobs_dir / "specs").glob("*.json")
    )
    return [Example(p, jobs_dir / f"{p.stem}.sbatch") for p in specs]


def stale_examples(jobs_dir: Path = JOBS_DIR) -> list[Example]:
    """Examples whose committed script differs from a fresh render (or is missing)."""
    out = []
    for ex in examples(jobs_dir):
        current = ex.script_path.read_text() if ex.script_path.exists() else None
        if current != ex.render():
            out.append(ex)
    return out


def render_all(jobs_dir: Path = JOBS_DIR) -> list[Path]:
    """Re-render every example; returns the scripts that changed. All specs are checked first."""
    rendered = [(ex, ex.render()) for ex in examples(jobs_dir)]  # fails before writing anything
    changed = []
    for ex, text in rendered:
        if not ex.script_path.exists() or ex.script_path.read_text() != text:
            write_atomic(ex.script_path, text, force=True, mode=0o755)
            changed.append(ex.script_path)
    return changed


def main(argv: list[str]) -> int:
    """``--check``: list stale renders (exit 1 if any); otherwise re-render them."""
    parser = argparse.ArgumentParser(prog="render_examples.py", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale renders")
    parser.add_argument("--jobs-dir", type=Path, default=JOBS_DIR, help="default: jobs/")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_examples(args.jobs_dir)
        for ex in stale:
            print(f"stale: {ex.script_path} (re-render from {ex.spec_path})")
        print(f"{len(examples(args.jobs_dir)) - len(stale)} up to date, {len(stale)} stale")
        return 1 if stale else 0
    changed = render_all(args.jobs_dir)
    for path in changed:
        print(f"rendered {path}")
    print(f"{len(examples(args.jobs_dir))} examples, {len(changed)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
