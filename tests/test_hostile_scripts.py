"""Hostile values in every data field of a rendered script: refused, or inert.

A table of cases (hostile_cases.py): one hostile value in one field, every value in every field
once, each field meeting every committed job spec (`hpc-ddp render`) and every launch variant
(`hpc-ddp launch --render-script`). Each case ends in one of two ways:

- refused: exit 2, the message names the field and shows the value, nothing is written. Every
  value holding a control character ends this way (the two file names excepted: they are not data
  fields, and the comments that record them escape what they hold);
- inert: the script is written and, run by bash with stub commands (hostile_support.py says which
  and why), exits 0 without running the injected command (``pwned`` creates a canary); the real
  sbatch reads exactly the directives meant, all of the safe render's among them; the header stays
  comments; and the value reaches the program unchanged (an argument, a variable, a directory).

Over all cases: no code ran, no file was lost, no run hung, no traceback. docs/security.md states
these counts; test_the_doc_states_the_table keeps it equal to this table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
from hostile_cases import (
    CASES,
    CONTROL,
    LAUNCH_FIELDS,
    PAYLOADS,
    PLAIN_OPTIONS,
    RENDER_FIELDS,
    SHELL_BY_DESIGN,
    Case,
)
from hostile_support import Stubs, make_stubs
from render_examples import JOBS_DIR

from hpc_ddp.cli import main
from hpc_ddp.commands import launch as launch_command
from hpc_ddp.deploy.sbatch.render import sbatch_directives
from hpc_ddp.deploy.spec import JobSpec, build_spec, load_spec_file

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "security.md"
FIELD_TABLE = REPO / "docs" / "job-spec.md"


@dataclass
class Tally:
    refused: int = 0
    inert: int = 0
    ran_code: int = 0
    lost_files: int = 0
    hangs: int = 0
    tracebacks: int = 0
    violations: list[str] = field(default_factory=list)


@dataclass
class World:
    """Stubs, the working directory every script runs in, and the file that must survive."""

    stubs: Stubs
    work: Path
    root: Path
    keep_text: str = "written by the test; must survive every case\n"
    safe_options: dict[Path, set[str]] = field(default_factory=dict)

    @property
    def keep(self) -> Path:
        return self.work / "keep.txt"

    def case_dir(self, i: int) -> Path:
        path = self.root / f"case{i}"
        path.mkdir()
        return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    if shutil.which("sbatch") is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but sbatch (slurm-wlm) is not installed")
        pytest.skip("sbatch (slurm-wlm) is not installed: it reads the #SBATCH lines here")
    root = tmp_path_factory.mktemp("hostile")
    work = root / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / ".venv" / "bin" / "activate").write_text("")  # what cifar specs' setup sources
    w = World(make_stubs(root / "stubs"), work, root)
    w.keep.write_text(w.keep_text)
    return w


def _cli(argv: list[str], environ: dict[str, str]) -> tuple[int, str, str | None]:
    """``hpc-ddp ARGV`` in this process, as if typed: sys.argv is what a shell would pass."""
    err = io.StringIO()
    with (
        mock.patch.object(sys, "argv", ["hpc-ddp", *argv]),
        mock.patch.dict(os.environ, environ),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            return main(argv), err.getvalue(), None
        except SystemExit as exc:  # argparse refusing a value
            return int(exc.code or 0), err.getvalue(), None
        except Exception:
            return -1, err.getvalue(), traceback.format_exc()


def _run(world: World, script: Path, tally: Tally, case: Case, **env: str) -> tuple[int, str]:
    log = script.with_name(script.name + ".log")
    try:
        with log.open("wb") as out:
            proc = subprocess.run(
                ["bash", str(script)],
                cwd=world.work,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=world.stubs.env(**env),
                timeout=20,
            )
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        tally.hangs += 1
        tally.violations.append(f"{case.id}: hung")
        rc = -1
    return rc, log.read_text(errors="replace")


def _check_case(world: World, case: Case, i: int, tally: Tally) -> None:
    world.stubs.reset()
    case_dir = world.case_dir(i)
    payload = PAYLOADS[case.payload]
    value = case.field.value.format(p=payload, dir=case_dir)
    if case.field.stub and "\x00" not in value:
        shutil.copy(world.stubs.bin / case.field.stub, value)
    runner = _render_case if case.area == "render" else _launch_case
    bad = runner(world, case, case_dir, value, tally)
    if world.stubs.canary.exists():
        tally.ran_code += 1
        bad.append("the injected command ran")
    if not world.keep.exists() or world.keep.read_text() != world.keep_text:
        tally.lost_files += 1
        bad.append("a file in the working directory was lost")
        world.keep.write_text(world.keep_text)
    tally.violations += [f"{case.id}: {b}" for b in bad]


def _refusal(case: Case, value: str, rc: int, err: str, written: Path, tally: Tally) -> list[str]:
    tally.refused += 1
    bad = [f"exit {rc}, not 2"] if rc != 2 else []
    bad += [f"message lacks {n!r}: {err!r}" for n in case.field.needles(value) if n not in err]
    if case.field.file_name:
        bad.append("a file name was refused; it should be escaped where it is recorded")
    return bad + ([f"{written} was written"] if written.exists() else [])


def _inert_common(case: Case, value: str, text: str, first_code: str, tally: Tally) -> list[str]:
    tally.inert += 1
    bad = [] if case.payload not in CONTROL or case.field.file_name else ["control char accepted"]
    head = text.split("\n" + first_code, 1)[0].split("\n")
    if any(not line.startswith("#") for line in head):
        bad.append(f"the comment header broke: {head!r}")
    return bad


def _render_case(world: World, case: Case, case_dir: Path, value: str, tally: Tally) -> list[str]:
    mapping = load_spec_file(case.base)
    case.field.put(mapping, value)
    spec_file = Path(value) if case.field.file_name else case_dir / "job.json"
    spec_file.write_text(json.dumps(mapping))
    out = case_dir / "job.sbatch"
    rc, err, tb = _cli(["render", "--config", str(spec_file), "--script-out", str(out)], {})
    if tb:
        tally.tracebacks += 1
        return [f"traceback:\n{tb}"]
    if rc != 0:
        return _refusal(case, value, rc, err, out, tally)
    text = out.read_text()
    bad = _inert_common(case, value, text, "#SBATCH", tally)
    meant = sbatch_directives(build_spec(spec_file))
    found = world.stubs.sbatch_arguments(out)
    if found != meant:
        bad.append(f"sbatch read {found}, meant {meant}")
    if not _safe_options(world, case.base) <= {d.split("=")[0] for d in found}:
        bad.append(f"directives of the safe render lost: {found}")
    slurm = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_NUM_NODES": "1"}
    return bad + _run_inert(world, case, out, value, set(found), tally, **slurm)


def _safe_options(world: World, base: Path) -> set[str]:
    if base not in world.safe_options:
        rendered = world.root / f"safe-{base.stem}.sbatch"
        rendered.write_text(Path(JOBS_DIR / f"{base.stem}.sbatch").read_text())
        found = world.stubs.sbatch_arguments(rendered)
        assert found == sbatch_directives(build_spec(base)), found  # the parser sees them all
        world.safe_options[base] = {d.split("=")[0] for d in found}
    return world.safe_options[base]


def _run_inert(world: World, case: Case, script: Path, value: str, evidence: set[str],
               tally: Tally, **env: str) -> list[str]:  # fmt: skip
    """Run the script; it must succeed, and the value must reach what it starts, intact."""
    rc, log = _run(world, script, tally, case, **env)
    bad = [f"the script exited {rc}: {log[-2000:]}"] if rc != 0 else []
    if "Traceback" in log:
        tally.tracebacks += 1
        bad.append("a traceback in the run")
    for call in world.stubs.calls():
        evidence |= call.strings()
    evidence |= {f"dir:{d}" for d in script.parent.glob("**/")}
    wanted = {form.format(v=value) for form in case.field.arrives}
    if wanted and not wanted & evidence:
        bad.append(f"{wanted} did not arrive intact; seen: {sorted(evidence)[:60]}")
    return bad


def _launch_case(world: World, case: Case, case_dir: Path, value: str, tally: Tally) -> list[str]:
    tool, rcmd, mode = case.base
    f = case.field.name
    script = Path(value) if case.field.file_name else case_dir / "launch.sh"
    argv = ["launch", tool, f"--rcmd={rcmd}", f"--mode={mode}", "--gpus-per-node=2",
            "--master-port=29500"]  # fmt: skip
    defaults = {
        "--hosts": "--hosts=node[0-1]",
        "--launch-id": "--launch-id=h1",
        "--state-dir": f"--state-dir={case_dir}/state",
        "--workdir": f"--workdir={case_dir}",
        "--python": f"--python={world.stubs.exe('python')}",
        "--tool-path": f"--tool-path={world.stubs.exe(tool)}",
    }
    argv += [flag for name, flag in defaults.items() if name != f]
    if f == "--workdir" and "\x00" not in value:
        Path(value).mkdir(parents=True)
    case.field.put(argv, value)
    command = ["worker.py", value] if f == "command argument" else ["worker.py", "x"]
    argv += ["--render-script", str(script), "--", *command]
    environ = {"NCCL_HOSTILE": value} if f == "forwarded variable" else {}
    rc, err, tb = _cli(argv, environ)
    if tb:
        tally.tracebacks += 1
        return [f"traceback:\n{tb}"]
    if rc != 0:
        return _refusal(case, value, rc, err, script, tally)
    bad = _inert_common(case, value, script.read_text(), "set -u", tally)
    return bad + _run_inert(world, case, script, value, set(), tally)


def _tally(world: World, cases: list[Case], offset: int) -> Tally:
    tally = Tally()
    for i, case in enumerate(cases):
        _check_case(world, case, offset + i, tally)
    return tally


def _assert_clean(tally: Tally, area: str, option: str = "") -> None:
    assert not tally.violations, f"{len(tally.violations)} violations:\n" + "\n".join(
        tally.violations[:40]
    )
    counts = (tally.ran_code, tally.lost_files, tally.hangs, tally.tracebacks)
    assert counts == (0, 0, 0, 0)
    doc = _doc_counts(area)
    assert (tally.refused, tally.inert) == (doc["refused"], doc["inert"]), (
        f"docs/security.md states {doc} {option}; the run gave {tally.refused} refused, "
        f"{tally.inert} inert"
    )


def _render_cases(plain_option: str | None) -> list[Case]:
    """The render cases of one plain #SBATCH option, or (None) of every other field."""
    return [
        c
        for c in CASES
        if c.area == "render"
        and (c.field.name == plain_option if plain_option else c.field.name not in PLAIN_OPTIONS)
    ]


def test_hostile_values_in_rendered_sbatch_scripts(world: World) -> None:
    """The other fields together; each plain #SBATCH option alone, where each must end as
    the doc says every one does (so declaring one more changes no count in the doc)."""
    _assert_clean(_tally(world, _render_cases(None), 0), "render")
    for i, name in enumerate(PLAIN_OPTIONS, start=1):
        _assert_clean(_tally(world, _render_cases(name), 10_000 * i), "plain option", name)


def test_hostile_values_in_rendered_launch_scripts(world: World) -> None:
    cases = [c for c in CASES if c.area == "launch"]
    _assert_clean(_tally(world, cases, 100_000), "launch")


def test_every_text_field_of_the_spec_is_in_the_table() -> None:
    text_fields = {
        f.name
        for f in JobSpec.__dataclass_fields__.values()
        if str(f.type) not in ("int", "bool", "int | None")
    }
    tabled = {f.name.split(" ")[0] for f in RENDER_FIELDS if not f.file_name}
    assert text_fields - SHELL_BY_DESIGN == tabled


# Flags of `hpc-ddp launch` that take text but are not in the table, and why.
LAUNCH_FLAGS_ELSEWHERE = {
    "--setup": "shell by design",
    "--via": "read by `stop` only",
    "action": "pdsh|clush|stop, argparse choices as --mode",
}


def test_every_text_flag_of_launch_is_in_the_table() -> None:
    parser = argparse.ArgumentParser()
    launch_command.add_arguments(parser)
    text_flags = {
        a.option_strings[-1] if a.option_strings else a.dest
        for a in parser._actions
        if a.type in (None, Path) and a.nargs != 0 and a.dest != "help"
    }
    tabled = {f.name.split(" ")[0] for f in LAUNCH_FIELDS} - {"forwarded", "command"}
    assert text_flags - set(LAUNCH_FLAGS_ELSEWHERE) == tabled


_DOC_LINE = re.compile(
    r"(?P<area>render|launch|plain option) cases: (?:each )?(?P<tried>\d+) tried "
    r"\((?P<refused>\d+) refused, "
    r"(?P<inert>\d+) rendered and inert\), 0 ran code, 0 lost files, 0 hangs, 0 tracebacks"
)


def _doc_counts(area: str) -> dict[str, int]:
    for m in _DOC_LINE.finditer(DOC.read_text()):
        if m.group("area") == area:
            return {k: int(m.group(k)) for k in ("tried", "refused", "inert")}
    raise AssertionError(f"docs/security.md states no '{area} cases: ...' line")


def test_the_doc_states_the_table() -> None:
    """The counts and the inputs in docs/security.md are this table's, so they cannot drift."""
    text = DOC.read_text()
    tried = {
        "render": len(_render_cases(None)),
        "launch": len([c for c in CASES if c.area == "launch"]),
        "plain option": len(_render_cases(PLAIN_OPTIONS[0])),
    }
    for area, count in tried.items():
        counts = _doc_counts(area)
        assert counts["tried"] == count, (area, counts, count)
        assert counts["tried"] == counts["refused"] + counts["inert"]
    for name in PAYLOADS:
        assert f"| {name} |" in text, f"docs/security.md does not list the input {name!r}"
    for f in (*RENDER_FIELDS, *LAUNCH_FIELDS):
        doc = FIELD_TABLE if f.name in PLAIN_OPTIONS else DOC
        assert f"`{f.name.split(' (')[0]}`" in doc.read_text(), f"{doc} does not name {f.name}"
