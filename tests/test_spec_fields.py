"""Every JobSpec field reaches Slurm as its declaration says (hpc_ddp.deploy.spec_fields), on
every executor, and every text field refuses what its class refuses. In-process: describe and
render run nothing; what the real sbatch and bash make of the scripts is test_hostile_scripts.py's.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from field_table import DOC, field_table, section_of
from hostile_cases import PAYLOADS

import hpc_ddp
from hpc_ddp.deploy.safe_text import CHOICE, DIRECTIVE, PATTERN, SHELL, TEXT_CLASSES, WORD
from hpc_ddp.deploy.sbatch.render import render, sbatch_directives
from hpc_ddp.deploy.spec import SLURM_FIELDS, JobSpec, build_spec
from hpc_ddp.errors import ConfigError
from hpc_ddp.schema import field_types, literal_choices

# A value of each field other than its default, as changes to a spec that takes it. A field
# without a line here fails the test below: a new #SBATCH option is its field and this line.
EXAMPLES: dict[str, dict[str, Any]] = {
    "nodes": {"nodes": 2},
    "gpus_per_node": {"gpus_per_node": 2},
    "gpus_per_process": {"gpus_per_node": 4, "gpus_per_process": 2},
    "procs_per_node": {"procs_per_node": 3},
    "workdir": {"workdir": "sub"},
    "env": {"env": {"FIELD_TEST": "1"}},
    "setup": {"setup": ["echo field-test"]},
    "python": {"python": "python3"},
    "module": {"module": "hpc_ddp.deploy.preflight", "args": []},
    "script": {"script": "job.py", "module": ""},
    "args": {"args": ["--run-dir", "r", "--epochs", "2"]},
    "container": {"container": {"runtime": "apptainer", "image": "img.sif"}},
    "name": {"name": "other"},
    "launcher": {"launcher": "torchrun"},
    "gpu_binding": {"gpus_per_node": 2, "gpu_binding": "gpus-per-task"},
    "partition": {"partition": "gpu"},
    "account": {"account": "proj"},
    "qos": {"qos": "high"},
    "constraint": {"constraint": "h100"},
    "reservation": {"reservation": "maint"},
    "exclusive": {"exclusive": True},
    "mail_type": {"mail_type": "END,FAIL"},
    "mail_user": {"mail_user": "me@example.org"},
    "time": {"time": "2:00:00"},
    "cpus_per_task": {"cpus_per_task": 4},
    "mem": {"mem": "64G"},
    "signal": {"signal": "USR2"},
    "signal_lead_s": {"signal_lead_s": 60},
    "requeue": {"requeue": False},
    "output": {"output": "logs/%x-%j.out"},
    "error": {"error": "%x-%j.err"},
    "per_rank_logs": {"per_rank_logs": True},
    "exit_wait_s": {"exit_wait_s": 30},
    "resv_ports": {"resv_ports": True},
    "preflight": {"preflight": False},
    "array": {"array": "0-3"},
    "extra_sbatch": {"extra_sbatch": ["--gres=nic:1"]},
}
# What the example of a field needs on both sides of the comparison (its base), if anything.
BASE: dict[str, Any] = {"args": ["--run-dir", "r"]}
BASES: dict[str, dict[str, Any]] = {
    "gpu_binding": {"gpus_per_node": 2},
    "gpus_per_process": {"gpus_per_node": 4},
    "signal": {"args": ["--run-dir", "r", "--requeue-signal", "USR1,USR2,TERM"]},
}
EXECUTORS = ("sbatch", "submitit", "local")


def _describe(data: dict[str, Any], executor: str, cwd: Path) -> str:
    spec = JobSpec.from_mapping(data)
    return hpc_ddp.describe(spec, executor, folder=cwd / "f", cwd=cwd).text


def test_every_field_is_rendered_passed_to_submitit_or_refused_naming_it(tmp_path: Path) -> None:
    """For each field, each executor: setting it changes what would be submitted, or the spec is
    refused with a message naming the field. What the declaration promises is checked too: a
    plain option's #SBATCH line and submitit parameter, the local executor's and submitit's
    notes of what they ignore or replace."""
    assert list(EXAMPLES) == list(SLURM_FIELDS), "one example per JobSpec field, in order"
    (tmp_path / "job.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "job.py").write_text("")
    silent = []
    for name, slurm in SLURM_FIELDS.items():
        base = {**BASE, **BASES.get(name, {})}
        changed = {**base, **EXAMPLES[name]}
        value = getattr(JobSpec.from_mapping(changed), name)
        for executor in EXECUTORS:
            before = _describe(base, executor, tmp_path)
            try:
                after = _describe(changed, executor, tmp_path)
            except ConfigError as err:
                assert re.search(rf"\b{name}\b", err.message), (name, executor, err.message)
                continue
            if after == before:
                silent.append(f"{name} on {executor}")
            noted = f"# not used: {name}: "
            if executor == "local" and slurm.slurm_only:
                assert noted in after, (name, after)
            if executor != "sbatch" and slurm.replaced:
                assert noted + slurm.replaced in after, (name, after)
            if slurm.plain and executor == "sbatch":
                line = slurm.sbatch if value is True else f"{slurm.sbatch}={value}"
                assert f"#SBATCH {line}\n" in after, (name, after)
            if slurm.plain and executor == "submitit":
                param = f"{slurm.submitit}={value}" if slurm.submitit else f"'{slurm.option}': "
                assert param in after, (name, after)
    assert not silent, f"fields that reach nothing and are not refused: {silent}"


def test_every_text_field_declares_what_it_may_hold() -> None:
    """A field a user writes text into has a class (the container table has its own rules)."""
    for name, slurm in SLURM_FIELDS.items():
        kind = field_types(JobSpec)[name]
        textual = kind in (str, list[str], dict[str, str], int | str) or literal_choices(kind)
        assert slurm.text in (*TEXT_CLASSES, ""), name
        assert bool(slurm.text) == bool(textual), name


def _hostile_spec(name: str, value: str) -> tuple[dict[str, Any], str]:
    """A spec mapping with ``value`` in field ``name``, and how a refusal names the field."""
    kind = field_types(JobSpec)[name]
    data: dict[str, Any] = dict(BASE)
    if kind == list[str]:
        data[name], label = [value], f"{name}[0]"
    elif kind == dict[str, str]:
        data[name], label = {"HOSTILE": value}, f"{name}['HOSTILE']"
    else:
        data[name], label = value, name
    if name == "script":
        data["module"] = ""
    return data, label


def _refused_by_class(text_class: str, value: str) -> bool:
    """What each class refuses, said here independently of hpc_ddp.deploy.safe_text."""
    control = [ch for ch in value if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")]
    if text_class == SHELL:
        return bool(set(control) - {"\t"})
    if control:
        return True
    if text_class == DIRECTIVE:
        return bool(re.search(r"[\s'\"\\#]|hetjob|packjob", value, re.IGNORECASE))
    return False


def _header(text: str) -> list[str]:
    """The #SBATCH lines sbatch reads: those before the first line that is no comment."""
    lines = []
    for line in text.splitlines()[1:]:
        if line and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            lines.append(line)
    return lines


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_every_text_field_refuses_what_its_class_refuses(payload: str) -> None:
    """Each hostile input in each text field of the spec, as the field's class says: refused
    with the field and the value named, or rendered with the #SBATCH header intact (a pattern's
    or a choice's value then being a plain word, a shell word's quoted)."""
    value = PAYLOADS[payload]
    for name, slurm in SLURM_FIELDS.items():
        if not slurm.text:
            continue
        data, label = _hostile_spec(name, value)
        try:
            spec = build_spec(overrides=data)
        except ConfigError as err:
            assert f"{label} {value!r}" in err.message, (name, err.message)
            continue
        assert not _refused_by_class(slurm.text, value), f"{name} took {value!r}"
        text = render(spec)
        assert _header(text) == [f"#SBATCH {d}" for d in sbatch_directives(spec)], (name, text)
        if slurm.text in (PATTERN, CHOICE):
            assert re.fullmatch(r"[A-Za-z0-9_.+-]+", value), f"{name} took {value!r}"
        if slurm.text == WORD:
            assert shlex.quote(value) in text, (name, text)


def test_the_field_table_in_the_docs_is_the_declarations() -> None:
    assert section_of(DOC.read_text()) == field_table(), (
        f"{DOC} is stale: run `python scripts/field_table.py`"
    )
