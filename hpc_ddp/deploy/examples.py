"""The committed jobs: ``jobs/specs/<name>.toml`` renders to ``jobs/<name>.sbatch``.

``hpc-ddp render --all-examples`` regenerates them; tests/test_jobs_up_to_date.py fails when a
template or a default changed and the committed renders were not regenerated.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.deploy.render import render
from hpc_ddp.deploy.spec import build_spec
from hpc_ddp.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
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
        return f"hpc-ddp render --config {rel} -o {out} (or: hpc-ddp render --all-examples)"

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


def write_atomic(path: Path, text: str, *, force: bool = False, mode: int = 0o644) -> None:
    """Write via a temporary file in the same directory and rename: never a half-written job."""
    if path.exists() and not force:
        raise ConfigError(f"{path} exists", hint="pass --force to overwrite it")
    if not path.parent.is_dir():
        raise ConfigError(
            f"directory {path.parent} does not exist", hint="create it or choose another -o path"
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def render_all(jobs_dir: Path = JOBS_DIR) -> list[Path]:
    """Re-render every example; returns the scripts that changed. All specs are checked first."""
    rendered = [(ex, ex.render()) for ex in examples(jobs_dir)]  # fails before writing anything
    changed = []
    for ex, text in rendered:
        if not ex.script_path.exists() or ex.script_path.read_text() != text:
            write_atomic(ex.script_path, text, force=True, mode=0o755)
            changed.append(ex.script_path)
    return changed
