"""The committed jobs/*.sbatch are exactly what their jobs/specs/* render to today.

Fails when a template, a default or a spec changed without `hpc-ddp render --all-examples`. And
the README's demo specs train on data a person can see being learnt.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from render_examples import JOBS_DIR, examples, stale_examples

from hpc_ddp.cli import main
from hpc_ddp.deploy.spec import build_spec

REQUIRED = {
    "cifar_2x8",
    "cifar_torchrun_2x8",
    "cifar_pernode_2x8",
    "local_cpu_2x2",
    "local_torchrun_2x2",
}


def test_every_required_job_has_a_spec_and_a_render() -> None:
    names = {ex.spec_path.stem for ex in examples()}
    assert names >= REQUIRED
    for ex in examples():
        assert ex.script_path.exists(), (
            f"{ex.script_path} missing: run hpc-ddp render --all-examples"
        )


def test_committed_renders_are_up_to_date() -> None:
    stale = [str(ex.script_path) for ex in stale_examples()]
    assert not stale, f"re-render with `hpc-ddp render --all-examples`: {stale}"


def test_check_detects_a_stale_render_and_regenerate_fixes_it(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    shutil.copytree(JOBS_DIR, jobs)
    target = jobs / "local_cpu_2x2.sbatch"
    target.write_text(target.read_text().replace("--nodes=2", "--nodes=3"))
    assert main(["render", "--all-examples", "--check", "--jobs-dir", str(jobs)]) == 1
    assert main(["render", "--all-examples", "--jobs-dir", str(jobs)]) == 0
    assert main(["render", "--all-examples", "--check", "--jobs-dir", str(jobs)]) == 0
    assert target.read_bytes() == (JOBS_DIR / "local_cpu_2x2.sbatch").read_bytes()


def test_the_readme_demos_train_on_data_that_is_learnt_over_the_epochs() -> None:
    """The easy synthetic data, the tests' default, reaches 100 % in the first epoch, which
    looks fake to someone trying the README: its demos take the hard variant (accuracy climbs
    over the epochs and stays well below 100 %) and enough epochs to show the climb."""
    for name in ("local_cpu_2x2", "local_torchrun_2x2"):
        args = build_spec(JOBS_DIR / "specs" / f"{name}.toml").args
        assert args[args.index("--synthetic-variant") + 1] == "hard", name
        assert int(args[args.index("--epochs") + 1]) >= 4, name
