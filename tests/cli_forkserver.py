"""`hpc-ddp` commands, each a process of its own, forked from one that made their imports once.

A table of refusals of a command that imports torch (the trainer's bad plug-ins) spent most of
each case importing torch again. ``ForkedCli`` starts this file as a server: it imports the
modules it is given, then forks one child per command. Each child is the console script itself
(``sys.exit(main())`` with its own ``sys.argv``, working directory, stdout and stderr files), so
its exit status, its messages and the interpreter's exit handling (a traceback, atexit) are those
of ``hpc-ddp`` typed in a shell. The server only imports: it runs no command and starts no
thread, so nothing held by another thread is copied into a child.

Protocol: one JSON line per command on stdin (argv, cwd, stdout and stderr paths); JSON lines
back: the child's ``pid`` when it starts, its ``rc`` (as ``subprocess`` reports it) once it has
exited.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


def _serve(preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # a child reads no stdin, as under `capture_output`
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _run_command(request)  # raises SystemExit: the interpreter ends the child for real
        replies.write(json.dumps({"pid": pid}) + "\n")  # what a timeout kills
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def _run_command(request: dict[str, object]) -> None:
    for fd, key in ((1, "stdout"), (2, "stderr")):
        out = os.open(str(request[key]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(str(request["cwd"]))
    sys.argv = ["hpc-ddp", *map(str, request["argv"])]  # type: ignore[call-overload]
    from hpc_ddp.cli import main

    sys.exit(main())  # hpc-ddp's console script


class ForkedCli:
    """``run(argv)`` is ``subprocess.run(["hpc-ddp", *argv], capture_output=True, text=True)``
    with the ``preload`` modules already imported; one command at a time."""

    def __init__(self, preload: list[str], env: dict[str, str], scratch: Path) -> None:
        self.scratch = scratch
        self._count = 0
        self._server = subprocess.Popen(
            [sys.executable, __file__, *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, start_new_session=True,
        )  # fmt: skip
        self._replies = b""

    def run(
        self, argv: list[str], cwd: Path | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        assert self._server.stdin is not None and self._server.stdout is not None
        self._count += 1
        out, err = (self.scratch / f"{self._count}.{name}" for name in ("out", "err"))
        request = {"argv": argv, "cwd": str(cwd or Path.cwd()), "stdout": str(out)}
        self._server.stdin.write(json.dumps({**request, "stderr": str(err)}).encode() + b"\n")
        self._server.stdin.flush()
        pid = json.loads(self._reply(60))["pid"]
        try:
            reply = self._reply(timeout)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)  # as subprocess.run's timeout does; the server goes on
            self._reply(60)
            raise subprocess.TimeoutExpired(["hpc-ddp", *argv], timeout) from None
        rc = json.loads(reply)["rc"]
        return subprocess.CompletedProcess(
            ["hpc-ddp", *argv], rc, out.read_text(errors="replace"), err.read_text(errors="replace")
        )

    def _reply(self, timeout: float) -> str:
        """The server's next line; read unbuffered, so that select sees what is not read yet."""
        assert self._server.stdout is not None
        fd, deadline = self._server.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired("the fork server", timeout)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the fork server ended (exit {self._server.wait()})")
            self._replies += chunk
        line, _, self._replies = self._replies.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        """End the server: at the end of its input, or killed with a child it still waits on."""
        if self._server.stdin is not None and not self._server.stdin.closed:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self._server.pid, signal.SIGKILL)
            self._server.wait()


if __name__ == "__main__":
    _serve(sys.argv[1:])
