"""The program hook (hpc_ddp/deploy/program.py): the deployment layer asks a job's program about
its arguments without importing it. The trainer answers through its hook, found by the CLI and
the public API (registered, hpc_ddp/programs.py) and by the installed package's entry point; a
program of the user's plugs in the same way. That the lower layers never import the trainer, not
even inside a function, is tests/test_import_graph.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

import hpc_ddp as api
from hpc_ddp import programs
from hpc_ddp.deploy import program
from hpc_ddp.deploy.job_assumptions import of_script, of_spec, summary_lines
from hpc_ddp.errors import ConfigError, HpcDdpError

PACKAGE = Path(api.__file__).parent
ROOT = PACKAGE.parent


# --- the trainer's hook ---------------------------------------------------------------------------
def test_the_entry_point_and_the_registered_hooks_agree() -> None:
    """pyproject.toml declares what the CLI and the API register, and it is a torch-free hook."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[program.ENTRY_POINT_GROUP] == programs.HOOKS
    code = (
        "import json, sys\nfrom hpc_ddp.deploy import program\n"
        "for module, where in json.loads(sys.argv[1]).items():\n"
        "    assert isinstance(program._load(module, where), program.ProgramHook), where\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(programs.HOOKS)],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def test_the_cli_and_the_api_check_the_trainers_arguments(tmp_path: Path) -> None:
    """Fresh interpreters, as a user starts them: the trainer's refusal comes through its hook
    from ``hpc-ddp render`` and from ``hpc_ddp.JobSpec`` / ``hpc_ddp.describe``."""
    (tmp_path / "job.toml").write_text('args = ["--epochs", "two"]\n')
    for argv in (["render", "--", "--epochs", "two"], ["submit", "--dry-run", "job.toml"]):
        cli = subprocess.run(
            [sys.executable, "-m", "hpc_ddp.cli", *argv],
            capture_output=True, text=True, timeout=60, cwd=tmp_path, env=_env(),
        )  # fmt: skip
        assert cli.returncode == 2, cli.stderr
        assert "args: the trainer would refuse its arguments: argument --epochs" in cli.stderr
    code = textwrap.dedent(
        """
        import hpc_ddp
        for make in (lambda: hpc_ddp.JobSpec(args=["--epochs", "two"]),
                     lambda: hpc_ddp.describe(hpc_ddp.JobSpec(args=["--config", "no.toml"]))):
            try:
                make()
            except hpc_ddp.ConfigError as err:
                print(err.message.splitlines()[-1])
        """
    )
    api_run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        cwd=tmp_path, env=_env(),
    )  # fmt: skip
    assert api_run.returncode == 0, api_run.stderr
    lines = api_run.stdout.splitlines()
    assert "the trainer would refuse its arguments: argument --epochs" in lines[0], lines
    assert "no.toml does not exist" in lines[1], lines


# --- a program of the user's, with its own hook --------------------------------------------------
class _OutHook(program.ProgramHook):
    """A program that writes into ``--out DIR`` and refuses ``--bad``."""

    name = "my program"

    def flags(self, args: Sequence[str]) -> program.ProgramFlags:
        if "--bad" in args:
            raise ConfigError("my program would refuse --bad")
        out = list(args)[list(args).index("--out") + 1] if "--out" in args else None
        return program.ProgramFlags(run_dir=out, signals=("USR2",))

    def launcher_requeue_args(self, signals: Sequence[str]) -> list[str]:
        return ["--on", ",".join(signals)]


def test_a_program_of_the_users_gets_its_run_dir_from_its_own_hook(tmp_path: Path) -> None:
    program.register("userprog.train", _OutHook())
    spec = api.JobSpec(module="userprog.train", args=["--out", "o"], signal="USR2")
    assert spec.program_hook is not None
    expected = api.RunPaths(tmp_path / "o")
    assert api.describe(spec, cwd=tmp_path).run_paths == expected
    # A rendered script without its spec: its `-m userprog.train` line is found by the hook.
    script = tmp_path / "job.sbatch"
    script.write_text(api.render(spec))
    plan = api.describe(script, cwd=tmp_path)
    assert plan.run_paths == expected and plan.program == "userprog.train"
    # submitit: the run dir is fixed in the task, with the hook's arguments for submitit.
    local = api.describe(spec, "local", folder=tmp_path / "logs", cwd=tmp_path)
    assert local.run_paths == expected
    assert "-m userprog.train --out o --on SIGUSR1,SIGUSR2,SIGTERM\n" in local.text
    # A torchrun job's batch shell looks for the requeue marker in that run dir.
    torchrun = api.render(spec.replace(launcher="torchrun"))
    assert '\nrequeue_marker=o/.requeue-job-"${SLURM_JOB_ID}"-restart-' in torchrun, torchrun
    # Its own refusals and signals are the spec's problems.
    with pytest.raises(ConfigError, match="args: my program would refuse --bad"):
        api.JobSpec(module="userprog.train", args=["--bad"])
    with pytest.raises(ConfigError, match="but my program listens for USR2"):
        api.JobSpec(module="userprog.train", args=["--out", "o"])
    # Without the hook the same module is a program deployment knows nothing about.
    assert api.describe(spec.replace(module="userprog.other"), cwd=tmp_path).run_paths is None


def test_a_hook_that_cannot_be_loaded_is_named(tmp_path: Path) -> None:
    program.register("userprog.broken", "userprog_missing_hook:HOOK")
    with pytest.raises(HpcDdpError, match=r"the hook of userprog.broken \(userprog_missing_hook"):
        api.JobSpec(module="userprog.broken")
    program.register("userprog.notahook", "os:sep")
    with pytest.raises(HpcDdpError, match="is a str, not a ProgramHook"):
        api.JobSpec(module="userprog.notahook")


def test_an_installed_programs_hook_is_found_by_its_entry_point(tmp_path: Path) -> None:
    """A package that declares ``[project.entry-points."hpc_ddp.programs"]`` (here its
    installed metadata, a .dist-info on the path) plugs its program in without registering."""
    site = tmp_path / "site"
    info = site / "userprog-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: userprog\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[hpc_ddp.programs]\nuserprog.train = userprog_hook:HOOK\n"
    )
    (site / "userprog_hook.py").write_text(
        textwrap.dedent(
            """
            from hpc_ddp.deploy.program import JobNeeds, ProgramFlags, ProgramHook

            class Hook(ProgramHook):
                name = "userprog"
                default_run_dir = "runs/userprog"

                def flags(self, args):
                    return ProgramFlags(signals=("USR1",))

                def result_lines(self, result):
                    return [f"  loss: {result['loss']}"]

                def job_needs(self, args):
                    return JobNeeds(run_dir=self.default_run_dir, imports=("json",))

            HOOK = Hook()
            """
        )
    )
    code = textwrap.dedent(
        """
        import hpc_ddp
        from hpc_ddp.deploy.job_assumptions import of_spec, summary_lines
        from hpc_ddp.deploy.program import result_lines
        spec = hpc_ddp.JobSpec(module="userprog.train", args=["--lr", "1"])
        print(hpc_ddp.describe(spec, cwd="/w").run_paths.root)
        print(result_lines({"loss": 0.5, "other": 1}, "userprog.train"))
        print([line for line in summary_lines(of_spec(spec)) if "assumes" in line])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env=_env(PYTHONPATH=f"{site}{os.pathsep}{ROOT}"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "/w/runs/userprog",
        "['  loss: 0.5']",
        "['  assumes: json import with that interpreter']",
    ], out.stdout


def test_the_trainers_needs_come_from_its_hook(tmp_path: Path) -> None:
    """render's summary and doctor --job ask the trainer's hook what it needs."""
    spec = api.JobSpec(args=["--synthetic", "--run-dir", "r"])
    assert of_spec(spec).needs is not None
    text = "\n".join(summary_lines(of_spec(spec)))
    assert "assumes: hpc_ddp and torch import" in text and "synthetic cifar10" in text
    found = of_script(api.render(spec))
    assert found is not None and found.needs is not None and found.needs.run_dir == "r"
    assert of_script("#!/bin/bash\nsrun python -u mine.py --run-dir r\n") is None


def test_a_module_a_batch_script_names_is_never_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch script is anyone's text (status and cancel read another user's): the module its
    ``-m`` names is only looked up among the hooks registered or installed. One on the path that
    would run code when imported stays unimported; the job is one without a known program."""
    (tmp_path / "planted_mod.py").write_text(
        f"open({str(tmp_path / 'ran')!r}, 'w').close()\nfrom hpc_ddp.deploy import program\n"
        "class H(program.ProgramHook):\n    pass\nHOOK = H()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    script = "#!/bin/bash\nsrun python -u -m planted_mod --run-dir r &\nwait\n"
    assert program.program_in_script(script) is None
    assert of_script(script) is None
    plan_path = tmp_path / "job.sbatch"
    plan_path.write_text(script)
    assert api.describe(plan_path, cwd=tmp_path).run_paths is None
    assert "planted_mod" not in sys.modules and not (tmp_path / "ran").exists()
