"""Pickles of plain data, read with bounds: no code runs, and memory and nesting stay bounded.

A file that someone else could write (an NCCL flight recorder dump in a shared run directory) is
a pickle: a program for a small stack machine, not data. Refusing every global keeps it from
running code, but not from building far more than it holds. A 9-byte ``BINBYTES8`` claiming 4
GB makes the C unpickler allocate all of it before it reads a byte; one-byte opcodes such as
``EMPTY_DICT`` or ``EMPTY_SET`` build objects a hundred times their size; references to earlier
objects (``BINGET``, ``DUP``) share one object many times over; a million nested tuples used as
a dict key crash the interpreter in ``hash()``; a ``LONG4`` integer of millions of digits cannot
even be printed.

So the opcodes are walked first (``pickletools.genops``, which reads every length against the
bytes there are and allocates nothing it was only told about), on a model of the unpickler's
stack that holds nesting depths instead of objects; only plain data passes: dicts, lists, tuples,
strings, bytes, numbers, booleans and None, with

* no global, ``REDUCE``, ``BUILD``, persistent id, extension or out-of-band buffer (no code),
  and no set (a dump holds none, and an empty set costs 216 bytes);
* integers within 64 bits (counters and nanosecond times fit);
* containers nested at most ``max_depth`` deep;
* an estimate of the memory the objects take, references included, within ``amplification``
  times the pickle's size plus ``slack``: the estimate stops a crafted file at its first
  objects, long before they are built.

Then the C unpickler builds the data, still refusing every global. Torch-free, standard library.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class PickleRefusedError(ValueError):
    """The pickle holds more than plain data, or would build more than its bounds allow."""


@dataclass(frozen=True)
class Limits:
    # About twice what the estimate gives for the dumps torch writes: room for other shapes of
    # plain data, far below what one-byte objects reach.
    amplification: int = 24
    slack: int = 1 << 20  # bytes: a tiny pickle may still build a few small objects
    max_depth: int = 32
    int_bits: int = 64  # integers in [-2**64, 2**64)


# Per object: a reference to it (a pointer in its container or on the stack), an empty container,
# a dict's entry (hash, key and value beyond the references counted with them), a memo slot.
_REF, _CONTAINER, _DICT_ITEM, _MEMO_SLOT = 8, 64, 24, 16

_SCALARS = {
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING",
    "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "NONE", "NEWTRUE", "NEWFALSE",
}  # fmt: skip
_EMPTY = {"EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE"}
_FROM_MARK = {"LIST", "DICT", "TUPLE"}
_TUPLE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_NOTHING = {"PROTO", "FRAME", "STOP"}


class _NoGlobals(pickle.Unpickler):
    """Builds containers and scalars only: any class or function reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise PickleRefusedError(f"refused {module}.{name}: plain data only")


def loads(data: bytes, limits: Limits = Limits()) -> Any:
    """The plain data in ``data``; ``PickleRefusedError`` naming what was refused and where,
    ``ValueError`` (or another ``pickle``/``EOFError`` error) for a malformed pickle."""
    check(data, limits)
    return _NoGlobals(io.BytesIO(data)).load()


def check(data: bytes, limits: Limits = Limits()) -> None:
    """Walk the opcodes of ``data`` without building anything (see the module docstring)."""
    _Model(data, limits).run()


class _Model:
    """The unpickler's stack and memo, holding each object's nesting depth (0 for a scalar; a
    string's own text, so that a refused ``STACK_GLOBAL`` can be named) instead of the object.
    A container's depth is taken when it is pushed or filled on the stack; a copy of it in the
    memo keeps the depth it had then, so a list filled after it was memoized counts less deep
    than it is: readers of the data must not recurse without a bound of their own."""

    def __init__(self, data: bytes, limits: Limits) -> None:
        self.data, self.limits = data, limits
        self.budget = limits.amplification * len(data) + limits.slack
        self.cost = 0
        self.pos = 0
        self.stack: list[int | str] = []
        self.marks: list[int] = []
        self.memo: list[int | str | None] = []
        self.memoized = 0  # defined entries: MEMOIZE's index
        self.handlers: dict[str, Callable[[Any], None]] = {
            **dict.fromkeys(_SCALARS, self.scalar),
            **dict.fromkeys(_EMPTY, self.empty),
            **dict.fromkeys(_FROM_MARK, self.from_mark),
            **dict.fromkeys(_TUPLE_N, self.tuple_n),
            **dict.fromkeys(_GETS, self.get),
            **dict.fromkeys(_PUTS, self.memoize),
            **dict.fromkeys(_NOTHING, lambda _arg: None),
            "APPEND": self.append,
            "APPENDS": self.appends,
            "SETITEM": self.setitem,
            "SETITEMS": self.setitems,
            "MARK": self.mark,
            "POP": self.pop_op,
            "POP_MARK": lambda _arg: self.pop_mark(),
            "DUP": lambda _arg: self.push(self.top(), 0),
            "MEMOIZE": lambda _arg: self.memoize(self.memoized),
        }

    def run(self) -> None:
        handlers = self.handlers
        for op, arg, pos in pickletools.genops(self.data):
            self.pos, self.name, self.arg = pos, op.name, arg
            handler = handlers.get(op.name)
            if handler is None:
                raise self.refuse_code(op.name)
            handler(arg)
            if self.cost > self.budget:
                raise self.refuse(
                    f"it would build more than {self.limits.amplification} times its size in "
                    "memory (repeated or nested objects)"
                )

    def refuse(self, why: str) -> PickleRefusedError:
        return PickleRefusedError(f"{why}, at byte {self.pos}")

    def refuse_code(self, name: str) -> PickleRefusedError:
        """Anything but plain data: a global (named, as the unpickler would look it up), a
        call, a persistent id, an extension, a buffer, a set."""
        if name == "STACK_GLOBAL" and len(self.stack) >= 2:
            return self.refuse(f"refused {self.stack[-2]}.{self.stack[-1]}: plain data only")
        if name in ("GLOBAL", "INST"):  # its argument is "module name"
            return self.refuse(f"refused {str(self.arg).replace(' ', '.')}: plain data only")
        return self.refuse(f"refused opcode {name}: plain data only")

    # --- objects ---------------------------------------------------------------------------
    def scalar(self, value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            bits = value.bit_length()
            if bits > self.limits.int_bits:
                raise self.refuse(
                    f"an integer of {bits} bits, more than the {self.limits.int_bits} plain "
                    "counters take"
                )
            size = 0 if -5 <= value <= 256 else sys.getsizeof(value)  # CPython's cached ints
        elif isinstance(value, (str, bytes)):
            size = 0 if len(value) <= 1 else sys.getsizeof(value)  # cached: "", "a", b"", ...
        else:
            size = 0 if value is None or isinstance(value, bool) else sys.getsizeof(value)
        self.push(value if isinstance(value, str) else 0, size)

    def empty(self, _arg: Any) -> None:
        self.push(1, _CONTAINER)

    def from_mark(self, _arg: Any) -> None:
        items = self.pop_mark()
        pairs = len(items) // 2 if self.name == "DICT" else 0
        self.push(1 + _deepest(items), _CONTAINER + pairs * _DICT_ITEM)

    def tuple_n(self, _arg: Any) -> None:
        items = [self.pop() for _ in range(_TUPLE_N[self.name])]
        self.push(1 + _deepest(items), _CONTAINER)

    def append(self, _arg: Any) -> None:
        self.fill([self.pop()])

    def appends(self, _arg: Any) -> None:
        self.fill(self.pop_mark())

    def setitem(self, _arg: Any) -> None:
        self.fill([self.pop(), self.pop()])
        self.cost += _DICT_ITEM

    def setitems(self, _arg: Any) -> None:
        items = self.pop_mark()
        self.fill(items)
        self.cost += _DICT_ITEM * (len(items) // 2)

    # --- the stack and the memo ------------------------------------------------------------
    def push(self, item: int | str, size: int) -> None:
        if isinstance(item, int) and item > self.limits.max_depth:
            raise self.refuse(f"containers nested more than {self.limits.max_depth} deep")
        self.stack.append(item)
        self.cost += _REF + size

    def pop(self) -> int | str:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise self.refuse("the stack runs out")
        return self.stack.pop()

    def top(self) -> int | str:
        if not self.stack:
            raise self.refuse("the stack is empty")
        return self.stack[-1]

    def mark(self, _arg: Any) -> None:
        self.marks.append(len(self.stack))

    def pop_op(self, _arg: Any) -> None:
        if self.marks and self.marks[-1] == len(self.stack):
            self.marks.pop()  # POP on an empty mark drops the mark, as the unpickler does
        else:
            self.pop()

    def pop_mark(self) -> list[int | str]:
        if not self.marks:
            raise self.refuse("no mark to pop to")
        cut = self.marks.pop()
        items, self.stack[cut:] = self.stack[cut:], []
        return items

    def fill(self, items: list[int | str]) -> None:
        """The container on top took ``items``: it is at least one deeper than the deepest."""
        container = self.top()
        if not isinstance(container, int) or container < 1:
            raise self.refuse("items added to something that is not a list or a dict")
        depth = 1 + _deepest(items)
        if depth > self.limits.max_depth:
            raise self.refuse(f"containers nested more than {self.limits.max_depth} deep")
        if depth > container:
            self.stack[-1] = depth

    def get(self, index: int) -> None:
        item = self.memo[index] if 0 <= index < len(self.memo) else None
        if item is None:
            raise self.refuse(f"memo entry {index} is read before it is written")
        self.stack.append(item)  # checked when it was pushed the first time
        self.cost += _REF

    def memoize(self, index: int) -> None:
        if index >= len(self.memo):
            self.cost += _MEMO_SLOT * (index + 1 - len(self.memo))
            if self.cost > self.budget:  # before the model's own memo grows to it
                raise self.refuse(f"memo index {index} is far beyond what the pickle holds")
            self.memo.extend([None] * (index + 1 - len(self.memo)))
        if self.memo[index] is None:
            self.memoized += 1
        self.memo[index] = self.top()


def _deepest(items: list[int | str]) -> int:
    return max([i for i in items if i.__class__ is int] or [0])  # type: ignore[type-var]
