"""What a value from a spec, a flag or the environment may carry into a rendered script.

Rendered scripts are read by three parsers: bash, sbatch (its ``#SBATCH`` lines) and a person.
Every rule that keeps data from turning into code or from hiding from a reviewer lives here:

- ``control_problem``: no data field may hold a control character (a newline ends a ``#SBATCH``
  or comment line and the rest runs in the batch shell).
- ``directive_problem``: a ``#SBATCH`` value cannot be shell-quoted (sbatch splits the line itself,
  with its own quotes, backslashes and ``#`` comments), so those characters are refused instead.
- ``comment_text``: text that must stay inside one ``#`` comment line (the recorded command, a file
  name) is escaped by construction, whatever it holds. The same holds for a line a command prints
  of text anyone could have written (``hpc-ddp status``'s run dir records, log file names): no
  terminal escape or line break in it reaches the terminal.

Quoting of shell words is ``shlex.quote``, applied where the scripts are built.
"""

from __future__ import annotations

import re
import unicodedata

# Unicode categories refused in every data field, and escaped in comments:
#   Cc  C0 controls, DEL and C1 controls: a newline or CR ends a shell/sbatch line, NUL truncates
#       the C strings sbatch reads, ESC and U+009B (CSI) drive terminals, U+0085 (NEL) is a line
#       break to Python and to many editors.
#   Zl, Zp  U+2028/U+2029: bash does not break lines there, but editors and str.splitlines do,
#       so a reviewer would read a different script from the one bash runs.
#   Cf  format characters, e.g. the bidirectional overrides that reorder what a reader sees.
#   Cs  lone surrogates (an argv byte that was not UTF-8): the script could not be written.
_REFUSED_CATEGORIES = frozenset({"Cc", "Zl", "Zp", "Cf", "Cs"})
_TAB = "\t"

# A variable name every shell accepts in `export NAME=...` (fullmatch: no trailing newline).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# One sbatch argument with nothing sbatch would interpret: no whitespace (it splits there), no
# quote or backslash (it strips them), no '#' (it starts a comment inside a #SBATCH line).
_DIRECTIVE_VALUE = re.compile(r"[^\s'\"\\#]+")
# sbatch reads these words anywhere in a #SBATCH line as the start of the next component of a
# heterogeneous job: every directive after that line would leave this job.
_HETJOB_WORDS = re.compile(r"hetjob|packjob", re.IGNORECASE)
# What a spec's text field may hold, by class. A field declares its class in its metadata
# (hpc_ddp.deploy.spec_fields); the checks, the docs' field table and the hostile-input tests
# read it there.
DIRECTIVE = "directive"
WORD = "word"
SHELL = "shell"
PATTERN = "pattern"
CHOICE = "choice"
TEXT_CLASSES = {
    DIRECTIVE: "an #SBATCH value: no control character, whitespace, quote, backslash or '#', "
    "nor the words hetjob/packjob",
    WORD: "a shell word, quoted where it lands: anything but a control character",
    SHELL: "shell lines, run as written: one line each (no control character but tab)",
    PATTERN: "its own full-match form (the field's text says which)",
    CHOICE: "one of the listed values",
}
# Control characters have no Unicode name; these are the ones a user is likely to meet.
_CONTROL_NAMES = {"\n": "LINE FEED", "\r": "CARRIAGE RETURN", "\t": "TAB", "\x00": "NUL"}


def describe(ch: str) -> str:
    """``U+000A LINE FEED``: a character named so a user can find it in their file."""
    name = unicodedata.name(ch, "") or _CONTROL_NAMES.get(ch, "control character")
    return f"U+{ord(ch):04X} {name}"


def is_refused(ch: str) -> bool:
    return unicodedata.category(ch) in _REFUSED_CATEGORIES


def control_problem(field: str, value: str, *, allow_tab: bool = False) -> str | None:
    """A message naming ``field`` and the first refused character of ``value``, or None."""
    for i, ch in enumerate(value):
        if is_refused(ch) and not (allow_tab and ch == _TAB):
            return (
                f"{field} {value!r}: {describe(ch)} at position {i} is a control character; "
                "values are data and must not hold line breaks or other control characters"
            )
    return None


def directive_problem(field: str, value: str) -> str | None:
    """Why ``value`` cannot be written into a ``#SBATCH`` line, or None."""
    if problem := control_problem(field, value):
        return problem
    if not _DIRECTIVE_VALUE.fullmatch(value):
        return (
            f"{field} {value!r}: an #SBATCH value cannot hold spaces, quotes, backslashes or '#' "
            "(sbatch splits and unquotes #SBATCH lines itself)"
        )
    if word := _HETJOB_WORDS.search(value):
        return (
            f"{field} {value!r}: sbatch reads {word.group(0)!r} anywhere in an #SBATCH line as the "
            "start of a heterogeneous job's next component; choose another value"
        )
    return None


def comment_text(text: str) -> str:
    """``text`` as it may appear after ``#`` on one line, or on a terminal: refused characters
    (ESC and every other control character included) are escaped, ``\x1b`` for ESC."""
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if is_refused(ch) else ch for ch in text
    )
