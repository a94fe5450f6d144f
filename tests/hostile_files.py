"""Hostile files for the reading tests: FIFOs, device nodes, symlinks, and a child process to read
them in, so a read that blocks or eats memory fails the test instead of hanging or starving it;
and a process that takes a lock and never lets go.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Prepended to every child: after its imports, cap its address space at what it uses plus
# 1 GiB, so a whole-file read of /dev/zero ends in MemoryError in a second, not in the OOM killer.
CAP_MEMORY = textwrap.dedent(
    """
    import resource
    def cap_memory(extra=1 << 30):
        with open("/proc/self/status") as fh:
            kib = next(int(line.split()[1]) for line in fh if line.startswith("VmSize:"))
        limit = kib * 1024 + extra
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    """
)


def run_child(code: str, *args: str, timeout: float = 90) -> dict[str, Any]:
    """Run ``code`` (which must print one JSON line last) in a fresh interpreter; a child still
    running after ``timeout`` s is killed and fails the test (a blocked read, typically)."""
    cmd = [sys.executable, "-c", CAP_MEMORY + textwrap.dedent(code), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the read did not end within {timeout} s: {exc.stderr}") from None
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"child failed (rc {done.returncode}): {done.stderr}"
    return json.loads(lines[-1])


@contextmanager
def lock_held_elsewhere(take: str) -> Iterator[None]:
    """A real process that runs ``take`` (Python that takes a lock, kept bound to a name so it
    is not collected) and then holds it, as a stopped or hung holder would, until the block
    ends."""
    code = f"{take}\nprint('held', flush=True)\nimport time\ntime.sleep(300)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.kill()
        holder.wait(timeout=30)


def make_fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def make_zero_device(path: Path) -> Path:
    """A character device node with /dev/zero's numbers: endless zeros (root only)."""
    path.unlink(missing_ok=True)
    os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 5))
    return path


def symlink_to(path: Path, target: str) -> Path:
    path.unlink(missing_ok=True)
    path.symlink_to(target)
    return path


class CodeRunner:
    """Unpickling this runs ``touch <canary>`` through os.system: it must never happen."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.canary}",))


def evil_pickle(canary: Path) -> bytes:
    """A CIFAR-looking batch (protocol 2, like the official files) whose unpickling runs code."""
    return pickle.dumps({"data": CodeRunner(canary), "labels": [0]}, protocol=2)


class Python2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes what Python 2's cPickle wrote for the official CIFAR files: every str and bytes as
    a py2 ``str`` (BINSTRING), numpy's reconstructor under ``numpy.core.multiarray``."""

    dispatch = pickle._Pickler.dispatch.copy()  # type: ignore[attr-defined]

    def save_py2_str(self, obj: str | bytes) -> None:
        data = obj if isinstance(obj, bytes) else obj.encode("latin-1")
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str
    dispatch[str] = save_py2_str

    def save_global(self, obj: Any, name: str | None = None) -> None:
        module = obj.__module__.replace("numpy._core.", "numpy.core.")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)


def python2_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    Python2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def snapshot(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every entry under ``root``: its bytes (None for anything but a regular file, read through
    no link) and mtime; equal before and after means left untouched."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        out[str(path.relative_to(root))] = (data, st.st_mtime_ns)
    return out
