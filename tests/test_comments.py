"""Comments and docstrings under hpc_ddp/ say why, not what a benchmark measured.

A timing, a rate or the card it came from goes stale with the next torch, driver or machine, and
a reader cannot tell a stale figure from a current one; benchmarks/NOTES.md keeps each figure
with its machine and date, and a comment points there. Only comments and docstrings (every bare
string statement) are read, through tokenize and ast: constants and messages are code.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_ddp"

# What a measurement looks like, each with what it would flag:
MEASUREMENT = {
    # a GPU model (upper case: a GRES type such as gpu:a100:8 is configuration)
    "card": re.compile(r"\b(?:[ABHV]100|[BH]200|GH200|L40S?)\b"),
    # a duration below a second: 0.385 ms, 5 us, 250-750 ms
    "timing": re.compile(r"\d(?:\.\d+)?\s?(?:ms|µs|us|ns)\b"),
    # a throughput: 19,896 samples/s
    "rate": re.compile(r"\d\s?k?\s?samples/s"),
    # a before/after pair: 0.385 -> 0.323, 19.3 % -> 2.0 %
    "before/after": re.compile(r"\d(?:\.\d+)?\s?(?:%|s|x)?\s?->\s?\d"),
}


def _commented_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each comment and each line of a bare string statement."""
    lines = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            lines.extend(
                (node.lineno + offset, text)
                for offset, text in enumerate(node.value.value.splitlines())
            )
    return lines


def measurements(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, text) for each comment or docstring line that quotes a measurement."""
    return [
        (line, kind, text.strip())
        for line, text in _commented_lines(source)
        for kind, pattern in MEASUREMENT.items()
        if pattern.search(text)
    ]


def test_no_comment_or_docstring_quotes_a_measurement() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {kind}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, kind, text in measurements(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "comments and docstrings say why, not what was measured: move each figure, with its "
        "machine and date, to benchmarks/NOTES.md and point there:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("source", "kinds"),
    [
        ("# 0.385 -> 0.323 ms on an H200\nx = 1\n", {"card", "timing", "before/after"}),
        ('"""270-880 ms for the first LeNet step."""\n', {"timing"}),
        ("def f():\n    '''DDP at 19,896 samples/s on 1 GPU.'''\n", {"rate"}),
        ("class C:\n    x = 1\n    '''19.3 % -> 2.0 % side by side'''\n", {"before/after"}),
        ("x = 1  # about 5 us a sample\n", {"timing"}),
    ],
)
def test_measurements_in_comments_and_docstrings_are_found(source: str, kinds: set[str]) -> None:
    assert {kind for _, kind, _ in measurements(source)} == kinds


@pytest.mark.parametrize(
    "source",
    [
        'TIMEOUT = "250 ms"\nPOLL_S = 0.01  # seconds between polls\n',  # code, not a comment
        'print("H100")\n',
        "# --gres=gpu:a100:8 asks for eight of the site's a100 GPUs\n",
        '"""A progress line: the loss, the learning rate, samples/s."""\n',
        '# Slurm\'s compressed counts, "2(x3),1" -> [2, 2, 2, 1]\n',
        "# at most every 0.5 s, a rename per step would load a parallel filesystem\n",
    ],
)
def test_code_and_plain_words_are_not_taken_for_measurements(source: str) -> None:
    assert measurements(source) == []
