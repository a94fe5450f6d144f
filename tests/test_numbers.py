"""Every number has a range: each numeric field and flag declares one (``hpc_ddp.schema.Range``),
and every way a value comes in (a flag, a spec or config file, the Python API) refuses NaN,
infinities, values just outside the range, 1e20, 10**30 and a float where an integer is meant,
naming the field, the value and the range, before anything runs or is written.

In-process where that is safe: argparse's refusal is a SystemExit(2), an HpcDdpError is what the
CLI prints as a named error, and any other exception (a traceback) fails the test. The commands
the issue reported run end to end. docs/security.md ("Numbers and spec files") lists the cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp import schema
from hpc_ddp.cli import COMMANDS, main
from hpc_ddp.deploy.shell.spec import LaunchSpec, make_spec
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm.config import ClusterConfig
from hpc_ddp.train import config as cfgmod
from hpc_ddp.train.config import TrainConfig

SETTINGS = (JobSpec, LaunchSpec, TrainConfig, ClusterConfig)
# What each command needs besides the flag under test, to get as far as that flag.
BASE_ARGV = {
    "submit": ["job.toml"],
    "status": ["7"],
    "logs": ["7"],
    "cancel": ["7"],
    "launch": ["pdsh", "--hosts", "n1"],
    "cluster": ["up"],
}


def numeric_fields(cls: type) -> list[tuple[str, type, schema.Range]]:
    kinds = schema.field_types(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = schema.numeric_kind(kinds[f.name])
        if kind is not None:
            rng = schema.range_of(f)
            assert rng is not None, f"{cls.__name__}.{f.name} is a number without a Range"
            out.append((f.name, kind, rng))
    return out


def bad_values(kind: type, rng: schema.Range) -> list[Any]:
    """NaN, both infinities, just below and above the range, 1e20, 10**30; for an integer also
    a float (even a whole one) and a bool."""
    below = rng.lo if rng.above else rng.lo - 1
    values = [math.nan, math.inf, -math.inf, below, rng.hi + 1, 1e20, 10**30]
    return [*values, 1.5, 2.0, True] if kind is int else values


def _parser(command: str) -> argparse.ArgumentParser:
    """The command's parser, built as hpc_ddp.cli builds it."""
    parser = argparse.ArgumentParser(prog=f"hpc-ddp {command}")
    importlib.import_module(f"hpc_ddp.commands.{command}").add_arguments(parser)
    return parser


def _actions(parser: argparse.ArgumentParser, prefix: list[str]) -> Iterator[Any]:
    """(argv prefix, action) of every option, sub-commands' (cluster up) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, [*prefix, name])
        elif action.option_strings:
            yield prefix, action


def number_flags() -> list[Any]:
    out = []
    for command in COMMANDS:
        base = BASE_ARGV.get(command, [])
        for prefix, action in _actions(_parser(command), []):
            if isinstance(action.type, schema.NumberArg):
                base_argv = prefix + base[len(prefix) :] if prefix else base
                flag = action.option_strings[0]
                out.append(pytest.param(command, base_argv, action, id=f"{command} {flag}"))
    return out


NUMBER_FLAGS = number_flags()


def test_every_numeric_setting_and_flag_declares_its_range() -> None:
    """A number without a Range cannot be declared: the settings classes' fields each carry one
    (numeric_fields asserts it), and no command parses a number with bare int or float."""
    assert all(numeric_fields(cls) for cls in SETTINGS)
    bare = [
        (command, action.option_strings)
        for command in COMMANDS
        for _prefix, action in _actions(_parser(command), [])
        if action.type in (int, float)
    ]
    assert bare == []
    flags = {p.values[2].option_strings[0] for p in NUMBER_FLAGS}
    assert {"--nodes", "--lr", "--timeout-s", "--wait-timeout", "--stop-grace"} <= flags


@pytest.mark.parametrize(("command", "base", "action"), NUMBER_FLAGS)
def test_every_number_flag_refuses_what_is_outside_its_range(
    command: str, base: list[str], action: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    kind, rng = action.type.kind, action.type.range
    flag = action.option_strings[0]
    for value in bad_values(kind, rng):
        text = str(value)
        with pytest.raises(SystemExit) as done:
            _parser(command).parse_args([*base, f"{flag}={text}"])
        err = capsys.readouterr().err
        assert done.value.code == 2, (flag, text, err)
        assert f"argument {flag}" in err and repr(text)[:30] in err, err
        assert f"expected {rng.describe(kind)}" in err, err


def _build(cls: type, name: str, value: Any) -> Any:
    """``cls`` with one field set to ``value``, built the way its users build it."""
    if cls is LaunchSpec:
        return make_spec(tool="pdsh", hosts="n[1-2]", command=["true"], **{name: value})
    if cls is ClusterConfig:
        return ClusterConfig(root=Path("/tmp/hpcddp-numbers"), **{name: value})
    return cls(**{name: value})


def _label(cls: type, name: str) -> str:
    """How a refusal names the field: launch problems name its flags (--timeout)."""
    if cls is LaunchSpec:
        return next(schema.flag_of(f) for f in dataclasses.fields(cls) if f.name == name)
    return name


SETTING_FIELDS = [
    pytest.param(cls, name, kind, rng, id=f"{cls.__name__}.{name}")
    for cls in SETTINGS
    for name, kind, rng in numeric_fields(cls)
]


@pytest.mark.parametrize(("cls", "name", "kind", "rng"), SETTING_FIELDS)
def test_every_numeric_field_refuses_what_is_outside_its_range(
    cls: type, name: str, kind: type, rng: schema.Range
) -> None:
    for value in bad_values(kind, rng):
        if cls is LaunchSpec and name == "nodes" and value == 0:
            continue  # a launch's 0 nodes means "one per host"
        with pytest.raises(ConfigError) as err:
            _build(cls, name, value)
        text = str(err.value)
        assert f"{_label(cls, name)}={repr(value)[:30]}" in text, text
        assert f"expected {rng.describe(kind)}" in text, text


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("e+", "e")  # TOML's 1e20; nan, inf, -inf are TOML's own words


@pytest.mark.parametrize(("kind_of_file"), ["toml", "json"])
@pytest.mark.parametrize(
    ("name", "kind", "rng"),
    [pytest.param(*f, id=f[0]) for f in numeric_fields(JobSpec)],
)
def test_a_spec_files_numbers_are_refused_and_nothing_is_rendered(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind_of_file: str,
    name: str,
    kind: type,
    rng: schema.Range,
) -> None:
    spec, out = tmp_path / f"job.{kind_of_file}", tmp_path / "job.sbatch"
    for value in bad_values(kind, rng):
        text = json.dumps({name: value}) if kind_of_file == "json" else f"{name} = {_toml(value)}"
        spec.write_text(text + "\n")
        code = main(["render", "-c", str(spec), "--script-out", str(out)])
        err = capsys.readouterr().err
        assert code == 2, (text, err)
        assert name in err and repr(value)[:30] in err and rng.describe(kind) in err, err
        assert not out.exists(), text


@pytest.mark.parametrize(
    ("name", "kind", "rng"),
    [pytest.param(*f, id=f[0]) for f in numeric_fields(TrainConfig)],
)
def test_a_config_files_numbers_are_refused(
    tmp_path: Path, name: str, kind: type, rng: schema.Range
) -> None:
    parser = argparse.ArgumentParser()
    cfgmod.add_arguments(parser)
    config = tmp_path / "train.toml"
    for value in bad_values(kind, rng):
        config.write_text(f"[train]\n{name} = {_toml(value)}\n")
        with pytest.raises(ConfigError) as err:
            cfgmod.from_args(parser.parse_args(["--config", str(config)]))
        assert name in str(err.value) and rng.describe(kind) in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
        (["train", "--timeout-s", "inf"], "argument --timeout-s: 'inf' is not a finite number"),
        (
            ["train", "--synthetic-train-size", "1e11"],
            "'1e11' is not an integer: expected an integer from 1 to 1000000",
        ),
        (["train", "--synthetic-train-size", "100000000000"], "'100000000000' is out of range"),
        (["render", "-c", "{dir}/job.toml"], "nodes=100000000000000000000 is out of range"),
        (
            ["launch", "pdsh", "--hosts", "n[1-2]", "--timeout", "10" + "0" * 29],
            "argument --timeout: '1000000000000000000000000000000' is out of range",
        ),
    ],
)
def test_the_reported_commands_end_in_a_named_refusal(
    tmp_path: Path, argv: list[str], needle: str
) -> None:
    """The real command line: exit 2, the value and its range named, no traceback, no run dir,
    no script."""
    (tmp_path / "job.toml").write_text("nodes = 100000000000000000000\n")
    before = sorted(tmp_path.iterdir())
    out = {
        "train": ["--synthetic", "--epochs", "1", "--run-dir", f"{tmp_path}/run"],
        "render": ["--script-out", f"{tmp_path}/job.sbatch"],
        "launch": ["--render-script", f"{tmp_path}/launch.sh", "--", "--epochs", "1"],
    }[argv[0]]
    cmd = [sys.executable, "-m", "hpc_ddp.cli", *[a.format(dir=tmp_path) for a in argv], *out]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and needle in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert sorted(tmp_path.iterdir()) == before
