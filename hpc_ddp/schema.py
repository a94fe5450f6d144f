"""One schema helper for every settings dataclass (JobSpec, TrainConfig, the launch options).

A settings class is a dataclass whose fields carry their help in metadata (``field_doc``). From
it this module derives, in one way for all of them: type checks of values from files and the
API (``from_mapping``), TOML/JSON loading (``load_file``) and the argparse flags
(``add_arguments`` / ``given_values``). Pure Python: no torch.

Coercion rules (the same for every class): an int field takes an integer (not a bool, not a
float); a float field takes an int or a float; a bool field takes true/false only; a str field a
string; ``list[str]`` a list of strings (or, for fields marked ``split=","``, one comma-separated
string); ``dict[str, str]`` a table whose values are strings or numbers; ``int | str`` an
integer or a string (the class reads the string's form); ``X | None`` also None;
a ``Literal`` of strings takes a string (the class itself says which ones are valid, so that all
of its problems are reported together, with its own field names). A field whose type is another
settings dataclass is a nested table (``[container]`` in TOML) checked by the same rules; its
flags carry the field's name as a prefix (``--container-image``), and ``merge`` lays flags over a
file's table key by key.

Every number has a range: an int or float field declares its ``Range`` in its metadata
(``range=``), and that one declaration is checked wherever a value comes in: its flag (parsed by
``number_type``), a file's value (``coerce``), the API (the class calls ``number_problems``).
A value that is not finite (NaN, infinity) or lies outside the range is refused naming the field,
the value and the range.

Files a user names (spec and config files, batch scripts) are read by ``read_text_file``:
regular files only, bounded, UTF-8, each problem a ConfigError naming the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import sys
import types
import typing
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from hpc_ddp.cluster._vars import ascii_int
from hpc_ddp.env_vars import GPUS_PER_PROCESS_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.regular_file import FileTooLargeError, NotRegularFileError, read_small

MISSING = dataclasses.MISSING

# The longest wait or timeout a setting takes: beyond it a value is a typo, not a plan.
YEAR_S = 365 * 86_400
# GPUs or processes on one node: more than any machine has, few enough that a layout's
# arithmetic (and what a script spells out) stays small.
MAX_PER_NODE = 1024
# Spec and config files hold a few hundred bytes; batch scripts a few KiB. The bound stops a
# planted or mistaken file (a log, an image) from being loaded whole, and keeps a parse short.
TEXT_FILE_LIMIT = 256 << 10
# A settings file nests a table or two ([container], [train]); deeper is not a settings file,
# and parsers and error messages recurse once per level.
MAX_NESTING = 16
# A TOML dotted key (a.b.c = 1, [a.b.c]) of more parts than that: tomllib's time and memory grow
# with the square of a key's parts (docs/security.md has the figures), so such a key is refused
# before parsing. Quoted parts count too; a part starts where no key character precedes it,
# which keeps the search linear.
_DOTTED_KEY = re.compile(
    rf"""(?<![\w-])(?:(?:[\w-]+|"[^"\n]*"|'[^'\n]*')[ \t]*\.[ \t]*){{{MAX_NESTING}}}"""
)
# An integer flag of more digits than ascii_int reads (18): out of every range, not "no integer".
_LONG_INT = re.compile(r"-?[0-9]+", re.ASCII)
# Plain ASCII decimal numbers (float() alone also takes '1_0', ' 1' and other scripts' digits),
# and the words for infinity and NaN, so that they are refused as such rather than as text.
_FLOAT_TEXT = re.compile(
    r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|infinity|nan)", re.I | re.A
)


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite, from ``lo`` to ``hi`` (``lo`` excluded
    when ``above``). ``why``: a reason worth showing with a refusal."""

    lo: float
    hi: float
    above: bool = False
    why: str = ""

    def bounds(self) -> str:
        """'from 1 to 65536', 'above 0, at most 100'."""
        lo, hi = _number_text(self.lo), _number_text(self.hi)
        return f"above {lo}, at most {hi}" if self.above else f"from {lo} to {hi}"

    def describe(self, kind: Any) -> str:
        """'an integer from 1 to 65536', 'a number above 0, at most 100', with the why."""
        text = f"{'an integer' if kind is int else 'a number'} {self.bounds()}"
        return f"{text} ({self.why})" if self.why else text

    def fault(self, value: Any, kind: Any) -> str | None:
        """None if ``value`` is a ``kind`` (int or float) in range, else what is wrong with it."""
        what = "an integer" if kind is int else "a number"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"is not {what}"
        if kind is int and not isinstance(value, int):
            return "is not an integer"
        if isinstance(value, float) and not math.isfinite(value):
            return "is not a finite number"
        low_ok = value > self.lo if self.above else value >= self.lo
        return None if low_ok and value <= self.hi else "is out of range"

    def problem(self, label: str, value: Any, kind: Any) -> str | None:
        """None if ``value`` is fine, else a message naming ``label``, the value and the range."""
        fault = self.fault(value, kind)
        return f"{label}={_shown(value)} {fault}: expected {self.describe(kind)}" if fault else None


PORT = Range(1, 65535, why="a TCP port")
# How long a command waits for something (a job, a log, a cluster) before it gives up.
WAIT_S = Range(0, YEAR_S, above=True)


def _number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _shown(value: Any) -> str:
    """A value as a message shows it: repr, cut short (a 5000-digit number says nothing more)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def range_of(f: dataclasses.Field[Any]) -> Range | None:
    return f.metadata.get("range")


def numeric_kind(kind: Any) -> Any:
    """int or float for a numeric annotation (``int | None`` included), else None."""
    base, _ = _optional(kind)
    return base if base in (int, float) else None


def number_problems(obj: Any, label: Any = None) -> list[str]:
    """Every numeric field of the settings object ``obj`` checked against its declared Range
    (None passes where the field allows it); ``label(name)`` names a field as its user wrote it.
    A numeric field without a Range is a bug of the class, raised as such."""
    kinds = field_types(type(obj))
    problems = []
    for f in dataclasses.fields(obj):
        kind = numeric_kind(kinds[f.name])
        if kind is None:
            continue
        rng = range_of(f)
        if rng is None:  # pragma: no cover - a schema bug, caught by the tests
            raise TypeError(f"{type(obj).__name__}.{f.name} is a number without a Range")
        value = getattr(obj, f.name)
        if value is None and _optional(kinds[f.name])[1]:
            continue
        if problem := rng.problem(label(f.name) if label else f.name, value, kind):
            problems.append(problem)
    return problems


@dataclasses.dataclass(frozen=True)
class NumberArg:
    """An argparse ``type`` for a number flag: ASCII digits only, checked against ``range``, so
    a bad value is refused by argparse (exit 2) naming the flag, the value and the range."""

    kind: type
    range: Range

    def __call__(self, text: str) -> int | float:
        if self.kind is int:
            value: Any = ascii_int(text)
        else:
            value = float(text) if _FLOAT_TEXT.fullmatch(text) else None
        what = "an integer" if self.kind is int else "a number"
        if value is not None:
            fault = self.range.fault(value, self.kind)
        elif self.kind is int and _LONG_INT.fullmatch(text):
            fault = "is out of range"
        else:
            fault = f"is not {what}"
        if fault:
            raise argparse.ArgumentTypeError(
                f"{_shown(text)} {fault}: expected {self.range.describe(self.kind)}"
            )
        return value


def number_type(kind: type, rng: Range) -> NumberArg:
    """The argparse ``type`` of a number flag with the range ``rng``."""
    return NumberArg(kind, rng)


def flag_type(cls: type, name: str) -> NumberArg:
    """``number_type`` of the numeric field ``name`` of ``cls``: a flag declared by hand (not
    by ``add_arguments``) still takes its range from the field."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    kind = numeric_kind(field_types(cls)[name])
    rng = range_of(f)
    if kind is None or rng is None:  # pragma: no cover - a schema bug
        raise TypeError(f"{cls.__name__}.{name} is not a number with a Range")
    return number_type(kind, rng)


def field_doc(text: str, *aliases: str, range: Range | None = None, **meta: Any) -> dict[str, Any]:
    """The metadata of a settings field, the one way every settings class declares a field:
    ``x: int = field(default=1, metadata=field_doc("help", "-X", range=Range(1, 9)))``.

    ``text``: its help; ``aliases``: more spellings of its flag (sbatch's ``"-J"``,
    ``"--job-name"``); ``range``: a number's Range. ``meta``: ``flag`` (its CLI name), ``split``
    (a separator that lets a list field be one string), ``choices`` (the flag's valid values),
    ``switch`` ((on, off): a choice flag that also reads as a switch, bare ``--FLAG`` meaning
    on and ``--no-FLAG`` off), ``cli=False`` (no flag)."""
    out = {"help": text, **meta}
    if aliases:
        out["aliases"] = aliases
    if range is not None:
        out["range"] = range
    return out


@cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (settings modules use postponed annotations)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def literal_choices(kind: Any) -> tuple[str, ...] | None:
    """The strings of a ``Literal["a", "b"]`` annotation, None for any other type."""
    if typing.get_origin(kind) is typing.Literal:
        return tuple(str(choice) for choice in typing.get_args(kind))
    return None


def _optional(kind: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


def type_name(kind: Any) -> str:
    base, optional = _optional(kind)
    name = getattr(base, "__name__", str(base)) if typing.get_origin(base) is None else str(base)
    return f"{name} or none" if optional else name


def coerce(
    kind: Any,
    value: Any,
    *,
    split: str | None = None,
    rng: Range | None = None,
) -> Any:
    """``value`` checked against ``kind``; raises TypeError saying what was expected.

    ``rng`` (a number field's Range) is named in a refusal of a value of the wrong type (the
    class checks the range itself, with its other rules).
    """
    kind, optional = _optional(kind)
    if value is None and optional:
        return None
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        if isinstance(value, kind):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table of settings, got {value!r}")
        try:
            return kind(**from_mapping(kind, value, source="table"))
        except ConfigError as err:
            valid = ", ".join(field_names(kind))
            raise TypeError(f"{err.message.removeprefix('table: ')} (valid: {valid})") from None
    if literal_choices(kind) is not None:
        kind = str
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError(
            f"expected {rng.describe(int) if rng else 'an integer'}, got {_shown(value)}"
        )
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TypeError(
            f"expected {rng.describe(float) if rng else 'a number'}, got {_shown(value)}"
        )
    if kind is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"expected a string, got {value!r}")
    if origin is list:
        if isinstance(value, str):
            if split:
                return [s for s in value.split(split) if s]
            raise TypeError(f"expected a list of strings, got the string {value!r}")
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return list(value)
        raise TypeError(f"expected a list of strings, got {value!r}")
    if origin is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f'expected a table of KEY = "value", got {value!r}')
        out = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, str | int | float):
                raise TypeError(f"{k}: expected a string value, got {v!r}")
            out[str(k)] = str(v)
        return out
    if _number_or_text(kind):
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise TypeError(f"expected an integer or a string, got {_shown(value)}")
    raise TypeError(f"unsupported field type {kind}")  # pragma: no cover - a schema bug


def _number_or_text(kind: Any) -> bool:
    """Whether ``kind`` is ``int | str``: a number, or a text of its own form (a field's class
    checks which, e.g. JobSpec's nodes "1-4")."""
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    return union and set(typing.get_args(kind)) == {int, str}


def from_mapping(
    cls: type, data: Mapping[str, Any], *, source: str, base: Any = None
) -> dict[str, Any]:
    """Checked keyword arguments for ``cls`` from plain data (a file, the API, flags).

    Keys may use '-' for '_'. Every unknown key (with the closest valid one) and every wrong
    type is reported at once; values not given come from ``base`` (an instance) if there is one.
    """
    kinds = field_types(cls)
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
    values: dict[str, Any] = dataclasses.asdict(base) if base is not None else {}
    problems = []
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in kinds:
            close = difflib.get_close_matches(key, kinds, n=1)
            maybe = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown key {raw_key!r}{maybe}")
            continue
        try:
            values[key] = coerce(
                kinds[key],
                value,
                split=meta[key].get("split"),
                rng=meta[key].get("range"),
            )
        except TypeError as err:
            problems.append(f"{key}: {err}")
    if problems:
        raise ConfigError(
            f"{source}: " + "; ".join(problems), hint="valid keys: " + ", ".join(kinds)
        )
    return values


def merge(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` over ``data``; a nested table (a dict on both sides) is merged key by key,
    so ``--container-image`` keeps the file's ``[container]`` mounts."""
    out = dict(data)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _toml_loads(text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 (tomli is a core dependency there)
        import tomli as tomllib
    return tomllib.loads(text)


def read_text_file(path: str | Path, *, what: str, limit: int = TEXT_FILE_LIMIT) -> str:
    """The text of a file a user named (a spec, a config file, a batch script): a regular file
    (a link to one is fine; a FIFO, a device or a directory is refused without waiting on it),
    at most ``limit`` bytes, UTF-8. Every problem is a ConfigError naming the file and the fix."""
    try:
        data = read_small(path, limit, follow_symlinks=True)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", hint="check the path") from None
    except NotRegularFileError as err:
        raise ConfigError(
            f"cannot read {what} {path}: it is {err.strerror}",
            hint=f"give the path of the {what} itself (a regular file)",
        ) from None
    except FileTooLargeError as err:
        raise ConfigError(
            f"cannot read {what} {path}: {err.strerror}",
            hint=f"check the path: a {what} is a small text file",
        ) from None
    except OSError as err:
        raise ConfigError(
            f"cannot read {what} {path}: {err.strerror}", hint="check the path"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start}",
            hint="save it as UTF-8 (or check the path: is it the file you meant?)",
        ) from None


def _nested_deeper(data: Any, limit: int) -> bool:
    """Whether tables and lists in ``data`` nest more than ``limit`` levels (counted without
    recursion: a TOML file's dotted keys build any depth without the parser recursing)."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend(
                (v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
            )
    return False


def load_file(path: str | Path, *, what: str, section: str | None = None) -> dict[str, Any]:
    """Plain data from a .toml or .json file (not yet checked). With ``section``, a top-level
    table of that name is used when present, so one file can hold several sections."""
    path = Path(path)
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(
            f"{what} {path}: unknown file type {path.suffix!r}", hint="use .toml or .json"
        )
    text = read_text_file(path, what=what)
    kind = path.suffix[1:].upper()
    too_deep = ConfigError(
        f"{what} {path}: tables and lists nested more than {MAX_NESTING} levels deep",
        hint=f"a {what} is a table of settings holding a table or two; check the file",
    )
    if kind == "TOML" and (deep := _DOTTED_KEY.search(text)):
        line = text.count("\n", 0, deep.start()) + 1
        raise ConfigError(
            f"{what} {path}: line {line}: a dotted key of more than {MAX_NESTING} parts",
            hint=f"a {what}'s keys are names such as nodes or container.image; check the file",
        )
    try:
        data = json.loads(text) if path.suffix == ".json" else _toml_loads(text)
    except RecursionError:
        raise too_deep from None
    except ValueError as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"{path}: invalid {kind}: {err}", hint="fix the syntax") from None
    if _nested_deeper(data, MAX_NESTING):
        raise too_deep
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a table of settings at the top level, not {type(data).__name__}"
        )
    if section and isinstance(data.get(section), dict):
        return data[section]
    return data


def flag_of(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flags_of(f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The flag and its aliases, as argparse takes them."""
    return (flag_of(f), *f.metadata.get("aliases", ()))


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: frozenset[str] = frozenset(),
    show_defaults: bool = True,
) -> None:
    """One flag per field. Defaults are SUPPRESSed, so ``given_values`` sees only given flags."""
    kinds = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        kind, _ = _optional(kinds[f.name])
        if dataclasses.is_dataclass(kind):
            add_table_arguments(parser, f.name, kind)
            continue
        notes = [rng.bounds()] if (rng := range_of(f)) else []
        notes += [f"default: {default_of(f)!r}"] if show_defaults else []
        help_text = f.metadata.get("help", "") + (f" ({'; '.join(notes)})" if notes else "")
        help_text = help_text.replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        origin = typing.get_origin(kind)
        if f.metadata.get("switch"):  # --flag [CHOICE] (bare: on) and --no-flag (off)
            on, off = f.metadata["switch"]
            choices = f.metadata.get("choices")
            parser.add_argument(*flags_of(f), nargs="?", const=on, choices=choices, **kw)
            no_help = f"same as {flag_of(f)} {off}"
            no_flag = "--no-" + flag_of(f)[2:]
            parser.add_argument(
                no_flag, dest=f.name, action="store_const", const=off, default=kw["default"],
                help=no_help,
            )  # fmt: skip
        elif kind is bool:
            parser.add_argument(*flags_of(f), action=argparse.BooleanOptionalAction, **kw)
        elif origin is list and f.metadata.get("split"):
            sep = f.metadata["split"]
            parser.add_argument(
                *flags_of(f), type=lambda s, sep=sep: [x for x in s.split(sep) if x], **kw
            )
        elif origin is list:
            parser.add_argument(*flags_of(f), action="append", metavar="VALUE", **kw)
        elif origin is dict:
            parser.add_argument(*flags_of(f), action="append", metavar="KEY=VALUE", **kw)
        elif f.metadata.get("choices"):
            parser.add_argument(*flags_of(f), choices=f.metadata["choices"], **kw)
        elif (choices := literal_choices(kind)) is not None:
            # No argparse choices: the class reports a wrong value with its other problems.
            parser.add_argument(*flags_of(f), metavar="{" + ",".join(choices) + "}", **kw)
        elif _number_or_text(kind):  # the class reads the text ("4", "1-4") itself
            parser.add_argument(*flags_of(f), type=str, metavar="VALUE", **kw)
        elif kind in (int, float):
            metavar = "N" if kind is int else "X"
            parser.add_argument(*flags_of(f), type=flag_type(cls, f.name), metavar=metavar, **kw)
        else:
            parser.add_argument(*flags_of(f), type=kind, metavar="VALUE", **kw)


def add_table_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, prefix: str, table: type
) -> None:
    """The flags of a nested table: ``--PREFIX-FIELD``, stored as ``PREFIX.FIELD``."""
    kinds = field_types(table)
    for f in dataclasses.fields(table):
        kind, _ = _optional(kinds[f.name])
        kw: dict[str, Any] = {
            "dest": f"{prefix}.{f.name}",
            "default": argparse.SUPPRESS,
            "help": f"[{prefix}] {f.metadata.get('help', '')}".replace("%", "%%"),
        }
        flag = f"--{prefix}-{f.name}".replace("_", "-")
        if typing.get_origin(kind) is list:
            parser.add_argument(flag, action="append", metavar="VALUE", **kw)
        elif (choices := literal_choices(kind)) is not None:
            parser.add_argument(flag, metavar="{" + ",".join(choices) + "}", **kw)
        else:
            parser.add_argument(flag, metavar="VALUE", **kw)


def given_table(args: argparse.Namespace, prefix: str, table: type) -> dict[str, Any]:
    """The fields of a nested table given as ``--PREFIX-FIELD`` flags (add_table_arguments)."""
    dests = {name: f"{prefix}.{name}" for name in field_names(table)}
    return {name: getattr(args, dest) for name, dest in dests.items() if hasattr(args, dest)}


def given_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` given as flags, with KEY=VALUE lists turned into tables (and a
    nested table's flags gathered into its table)."""
    kinds = field_types(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind, _ = _optional(kinds[f.name])
        if dataclasses.is_dataclass(kind):
            if nested := given_table(args, f.name, kind):
                out[f.name] = nested
            continue
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if typing.get_origin(_optional(kinds[f.name])[0]) is dict:
            table = {}
            for item in value:
                key, sep, val = item.partition("=")
                if not sep:
                    raise ConfigError(f"{flag_of(f)} {item!r}: expected KEY=VALUE")
                table[key] = val
            value = table
        out[f.name] = value
    return out


def gpus_per_process_setting(value: int | None, name: str = "gpus_per_process") -> int | None:
    """A gpus_per_process read from a file or a flag: 0 there has always meant "not given",
    which is None everywhere else."""
    if value is not None and value < 0:
        raise ConfigError(
            f"{name}={value} is negative",
            hint="give the GPUs one process drives (1 = one process per GPU), or 0 to leave it "
            f"to ${GPUS_PER_PROCESS_VAR} (else 1)",
        )
    return value or None


# --nproc-per-node's declared range (train and exec); the spawn checks the machine's bound.
NPROC_PER_NODE = Range(1, MAX_PER_NODE)
