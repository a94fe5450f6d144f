"""The table of tests/test_hostile_scripts.py: hostile inputs, the fields they go into, the cases.

A ``Field`` is one place a value can go: a JobSpec field (through `hpc-ddp render`), a flag of
`hpc-ddp launch --render-script`, an inherited variable, or one of two file names the toolkit
records in a comment. ``CASES`` puts every payload into every field once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from render_examples import JOBS_DIR, examples

from hpc_ddp.deploy.safe_text import DIRECTIVE
from hpc_ddp.deploy.spec import SLURM_FIELDS

PAYLOADS = {
    "newline, then a command": "a\npwned",
    "trailing newline": "a\n",
    "carriage return": "a\rpwned",
    "NUL byte": "a\x00pwned",
    "tab": "a\tpwned",
    "line separator U+2028": "a\u2028pwned",
    "next line U+0085": "a\x85pwned",
    "right-to-left override U+202E": "a\u202epwned",
    "command substitution": "$(pwned)",
    "backticks": "`pwned`",
    "command separators": "a;pwned|pwned&&pwned",
    "single-quote breakout": "a';pwned;'",
    "double-quote breakout": 'a";pwned;"',
    "trailing backslash": "a\\",
    "space, comment, variable, glob": "a #$HOME *",
    "pdsh/clush placeholders": "%h%n%u%%",
    "sbatch hetjob separator": "hetjob",
    "option injection": "-oProxyCommand=pwned",
}
CONTROL = set(list(PAYLOADS)[:8])  # the ones holding a control or line-breaking character


@dataclass(frozen=True)
class Field:
    """One place a hostile value can go.

    ``put`` adds the value to the input (a spec mapping, or the argv and environment of a launch);
    ``value`` builds it from the payload (``{p}``) and the case's directory (``{dir}``), and
    ``stub`` puts an executable at that path, so a hostile path is used and seen. A refusal must
    show ``f"{label} {value!r}"``; an inert value must show up in what the stubs and sbatch saw as
    one of ``arrives`` (``{v}`` = the value). ``label=""`` marks the two file names: not data
    fields, but names the toolkit records in a comment.
    """

    name: str
    put: Callable[[Any, str], None]
    label: str
    arrives: tuple[str, ...] = ()
    value: str = "{p}"
    stub: str | None = None

    @property
    def file_name(self) -> bool:
        return not self.label

    def needles(self, value: str) -> tuple[str, ...]:
        if self.name == "--env name":  # the message shows the name, the part before '='
            return (f"--env {value.partition('=')[0]!r}",)
        return (f"{self.label} {value!r}",) if self.label else ()


def _key(key: str) -> Callable[[dict[str, Any], str], None]:
    return lambda spec, v: spec.__setitem__(key, v)


def _key_list(key: str) -> Callable[[dict[str, Any], str], None]:
    return lambda spec, v: spec.__setitem__(key, [v])


def _script(spec: dict[str, Any], v: str) -> None:
    spec.update(script=v, module="")


def _first_arg(spec: dict[str, Any], v: str) -> None:
    spec["args"] = [v, *spec.get("args", [])]


def _env_value(spec: dict[str, Any], v: str) -> None:
    spec["env"] = {**spec.get("env", {}), "HOSTILE": v}


def _env_key(spec: dict[str, Any], v: str) -> None:
    spec["env"] = {v: "1"}


def _container(key: str, as_list: bool = False) -> Callable[[dict[str, Any], str], None]:
    """A [container] table (apptainer: the stub runs the command) with ``key`` = the value."""

    def put(spec: dict[str, Any], v: str) -> None:
        spec["container"] = {"runtime": "apptainer", "image": "img.sif", key: [v] if as_list else v}

    return put


def _nowhere(_target: Any, _v: str) -> None:
    """The runner places it: a file name, a command argument, an inherited variable."""


def _directive(key: str, option: str) -> Field:
    return Field(key, _key(key), key, (f"--{option}={{v}}",))


# The plain #SBATCH options with a text value (--OPTION=VALUE), from the fields' declarations:
# a new one is in the table as soon as it is declared.
PLAIN_OPTIONS = [name for name, s in SLURM_FIELDS.items() if s.plain and s.text == DIRECTIVE]
RENDER_FIELDS = [
    Field("name", _key("name"), "name", ("--job-name={v}",)),
    Field("nodes", _key("nodes"), "nodes", ("--nodes={v}",)),
    *(_directive(k, k) for k in ("time", "mem", "array", "output", "error")),
    *(_directive(name, SLURM_FIELDS[name].option) for name in PLAIN_OPTIONS),
    Field("extra_sbatch", _key_list("extra_sbatch"), "extra_sbatch[0]", ("{v}",), "--comment={p}"),
    *(Field(k, _key(k), k) for k in ("launcher", "gpu_binding", "signal")),
    Field("module", _key("module"), "module", ("{v}",)),
    Field("script", _script, "script", ("{v}",)),
    Field("python", _key("python"), "python", ("{v}",), value="{dir}/py{p}", stub="python"),
    Field("args", _first_arg, "args[0]", ("{v}",)),
    Field("env value", _env_value, "env['HOSTILE']", ("HOSTILE={v}",)),
    Field("env key", _env_key, "env key", ("{v}=1",)),
    Field("container runtime", _container("runtime"), "container.runtime"),
    Field("container image", _container("image"), "container.image", ("{v}",)),
    Field("container mounts", _container("mounts", True), "container.mounts[0]", ("{v}",), "/m{p}"),
    Field("container workdir", _container("workdir"), "container.workdir", ("{v}",), "/w{p}"),
    Field("container env", _container("env", True), "container.env[0]"),
    Field("spec file name (recorded command)", _nowhere, "", value="{dir}/job{p}.json"),
]
# JobSpec's text fields that are shell by design, not data: tested in test_render.py.
SHELL_BY_DESIGN = {"setup"}


def _flag(flag: str) -> Callable[[list[str], str], None]:
    return lambda argv, v: argv.append(f"{flag}={v}")


def _container_flag(flag: str) -> Callable[[list[str], str], None]:
    """A --container-* flag, with an image unless the flag is the image."""

    def put(argv: list[str], v: str) -> None:
        argv.extend([] if flag == "--container-image" else ["--container-image=img.sif"])
        argv.append(f"{flag}={v}")

    return put


def _env_value_flag(argv: list[str], v: str) -> None:
    argv.append(f"--env=HOSTILE={v}")


def _env_name_flag(argv: list[str], v: str) -> None:
    argv.append(f"--env={v}=1")


def _launch(flag: str, arrives: tuple[str, ...] = (), **kw: str) -> Field:
    return Field(flag, _flag(flag), flag, arrives, **kw)


LAUNCH_FIELDS = [
    _launch("--hosts", value="node0,{p}"),
    _launch("--master-addr", ("--master-addr={v}", "HPC_DDP_MASTER_ADDR={v}")),
    _launch("--launch-id", ("HPC_DDP_LAUNCH_ID={v}",)),
    Field("--env value", _env_value_flag, "env HOSTILE", ("HOSTILE={v}",)),
    Field("--env name", _env_name_flag, "--env", ("{v}=1",)),
    Field("forwarded variable", _nowhere, "env NCCL_HOSTILE", ("NCCL_HOSTILE={v}",)),
    _launch("--workdir", ("cwd:{v}",), value="{dir}/wd{p}"),
    _launch("--python", ("{v}",), value="{dir}/py{p}", stub="python"),
    _launch("--state-dir", ("dir:{v}",), value="{dir}/state{p}"),
    _launch("--tool-path", ("{v}",), value="{dir}/tool{p}", stub="pdsh"),
    Field("command argument", _nowhere, "command argument 1", ("{v}",)),
    Field("--container-runtime", _container_flag("--container-runtime"), "--container-runtime"),
    Field("--container-image", _container_flag("--container-image"), "--container-image", ("{v}",)),
    Field(
        "--container-mounts",
        _container_flag("--container-mounts"),
        "--container-mounts[0]",
        ("{v}",),
        "/m{p}",
    ),
    Field(
        "--container-workdir",
        _container_flag("--container-workdir"),
        "--container-workdir",
        ("{v}",),
        "/w{p}",
    ),
    Field("--container-env", _container_flag("--container-env"), "--container-env[0]"),
    *(Field(f, _flag(f), f"argument {f}: invalid choice:") for f in ("--mode", "--rcmd")),
    Field("--render-script file name", _nowhere, "", value="{dir}/launch{p}.sh"),
]
LAUNCH_VARIANTS = [
    ("pdsh", "ssh", "torchrun"),
    ("clush", "ssh", "processes"),
    ("pdsh", "exec", "processes"),
]
BASE_SPECS = [ex.spec_path for ex in examples(JOBS_DIR)]


@dataclass(frozen=True)
class Case:
    area: str  # "render" or "launch"
    base: Any  # a committed spec path, or a launch variant
    field: Field
    payload: str

    @property
    def id(self) -> str:
        base = self.base.stem if self.area == "render" else "/".join(self.base)
        return f"{self.area} {base}: {self.field.name} <- {self.payload}"


def _possible(f: Field, payload: str) -> bool:
    """File names and environment variables cannot hold NUL: no such input can exist."""
    return "\x00" not in payload or not (f.file_name or f.name == "forwarded variable")


def _cases(area: str, fields: list[Field], bases: list[Any]) -> list[Case]:
    """Every field x every payload, once each (the suite stays fast). The base rotates like a
    Latin square, so every field and every payload meets every base spec or launch variant."""
    return [
        Case(area, bases[(i + j) % len(bases)], f, name)
        for i, f in enumerate(fields)
        for j, name in enumerate(PAYLOADS)
        if _possible(f, PAYLOADS[name])
    ]


CASES = [
    *_cases("render", RENDER_FIELDS, BASE_SPECS),
    *_cases("launch", LAUNCH_FIELDS, LAUNCH_VARIANTS),
]
