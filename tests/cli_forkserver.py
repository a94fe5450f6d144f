"""`hpc-ddp` commands, each a process of its own, forked from one that made their imports once.

A table of refusals of a command that imports torch (the trainer's bad plug-ins) spent most of
each case importing torch again. ``ForkedCli`` starts this file as a server: it imports the
modules it is given, then forks one child per command. Each child is the console script itself
(``sys.exit(main())`` with its own ``sys.argv``, environment, working directory, stdout and
stderr files), so its exit status, its messages and the interpreter's exit handling (a
traceback, atexit) are those of ``hpc-ddp`` typed in a shell. The server only imports and
reaps: it runs no command and starts no thread, so nothing held by another thread is copied
into a child. Several commands may run at once (a test that holds one run while it starts
another).

A command may also be a Python script (``script``): the child runs it as ``python SCRIPT ARGS``
would; or on N ranks (``ranks``): the child is then the launcher of ``hpc-ddp train
--nproc-per-node N`` (hpc_ddp.spawn), whose forked workers each run the script so, with torch's
env:// variables set as torchrun sets them; or a function of a test module on N ranks
(``call``), as ``torch.multiprocessing.spawn`` calls it, with the rank first. For the processes
a test needs to get its ranks, where neither the interpreter's start nor the launcher is what is
tested.

Protocol: one JSON line per command on stdin (id, argv, env, cwd, stdout and stderr paths,
whether argv is a script, a function to call, on how many ranks); JSON lines back, each with
the command's id: the child's ``pid`` when it starts, its ``rc`` (as ``subprocess`` reports it)
once it exited.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

_REAP_EVERY_S = 0.02  # how often the server looks for children that exited


def _serve(scratch: str, preload: list[str]) -> None:
    """Serve until stdin ends and every child has exited; then remove ``scratch``, the dir of
    the children's output files (the client has read them, or has gone)."""
    for name in preload:
        importlib.import_module(name)
    requests = os.dup(0)
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # a child reads no stdin, as under `capture_output`
    running: dict[int, int] = {}  # pid -> the command's id
    pending, reading = b"", True

    def reply(**fields: int) -> None:
        replies.write(json.dumps(fields) + "\n")
        replies.flush()

    while reading or running:
        if reading and select.select([requests], [], [], _REAP_EVERY_S)[0]:
            chunk = os.read(requests, 65536)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(requests)
                    replies.close()  # flushed after each reply: nothing is written twice
                    _run_command(request)  # raises SystemExit: the interpreter ends the child
                running[pid] = request["id"]
                reply(id=request["id"], pid=pid)  # what a timeout kills
        elif not reading:
            time.sleep(_REAP_EVERY_S)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply(id=running.pop(pid), rc=os.waitstatus_to_exitcode(status))
    shutil.rmtree(scratch, ignore_errors=True)


def _run_command(request: dict[str, object]) -> None:
    out = os.open(str(request["stdout"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    if request["stderr"] == request["stdout"]:  # one file, one offset: stderr=STDOUT
        os.dup2(out, 2)
    else:
        err = os.open(str(request["stderr"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(err, 2)
        os.close(err)
    os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])  # type: ignore[arg-type]
    _as_a_fresh_interpreter()
    os.chdir(str(request["cwd"]))
    if request.get("call"):
        from hpc_ddp.spawn import launch

        module, name, args = request["call"]  # type: ignore[misc]
        function = getattr(importlib.import_module(module), name)
        sys.exit(launch(lambda: _call_on_rank(function, args), int(request["ranks"])))  # type: ignore[call-overload]
    if request["script"]:
        script = os.path.abspath(str(request["argv"][0]))  # type: ignore[index]
        sys.argv = [script, *map(str, request["argv"][1:])]  # type: ignore[index]
        sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it
        if not request["ranks"]:  # the interpreter ends the child, as it ends `python SCRIPT`
            runpy.run_path(script, run_name="__main__")
            sys.exit(0)
        from hpc_ddp.spawn import launch

        sys.exit(launch(lambda: _run_script(script), int(request["ranks"])))  # type: ignore[call-overload]
    sys.argv = ["hpc-ddp", *map(str, request["argv"])]  # type: ignore[call-overload]
    from hpc_ddp.cli import main

    sys.exit(main())  # hpc-ddp's console script


def _as_a_fresh_interpreter() -> None:
    """What the environment says at an interpreter's start, which the server's start did not
    see: unbuffered output (PYTHONUNBUFFERED, as ``python -u``), torch's thread count."""
    if os.environ.get("PYTHONUNBUFFERED"):
        for fd, name in ((1, "stdout"), (2, "stderr")):
            old = getattr(sys, name)
            raw = io.FileIO(fd, "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, old.encoding, old.errors, write_through=True))
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _leave_after(body: Callable[[], object]) -> None:
    """One forked rank: run ``body``, then out through ``os._exit`` with the status the
    interpreter would give (an exception's traceback, 1; ``sys.exit("message")``, 1), as
    spawn's workers leave."""
    code = 0
    try:
        body()
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _call_on_rank(function: object, args: list[object]) -> None:
    """One forked rank: ``function(rank, *args)``."""
    _leave_after(lambda: function(int(os.environ["RANK"]), *args))  # type: ignore[operator]


def _run_script(script: str) -> None:
    """One forked rank: ``script`` as ``__main__``."""
    _leave_after(lambda: runpy.run_path(script, run_name="__main__"))


class ForkedProcess:
    """One command of a ``ForkedCli``, used as the ``subprocess.Popen`` it stands for: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, cli: ForkedCli, command_id: int, pid: int, argv: list[str]) -> None:
        self._cli, self._id = cli, command_id
        self.pid, self.args = pid, argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._finish(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._finish(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def _finish(self, timeout: float | None) -> int | None:
        self.returncode = self._cli._result(self._id, "rc", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: never signal a pid that may be reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedCli:
    """``run(argv)`` is ``subprocess.run(["hpc-ddp", *argv], capture_output=True, text=True)``
    and ``start(argv, log)`` is ``subprocess.Popen(["hpc-ddp", *argv], stdout=log,
    stderr=STDOUT)``, with the ``preload`` modules already imported. Each command gets the
    environment it is given (else the server's, ``env``). ``scratch``: a dir for ``run``'s
    output files, the server's own: it removes the dir when it ends."""

    def __init__(self, preload: list[str], env: dict[str, str], scratch: Path) -> None:
        self.scratch = scratch
        self.env = env
        self._count = 0
        self._server = subprocess.Popen(
            [sys.executable, __file__, str(scratch), *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, start_new_session=True,
        )  # fmt: skip
        self._replies = b""
        self._results: dict[tuple[int, str], int] = {}

    def start(
        self,
        argv: list[str],
        stdout: Path,
        stderr: Path | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        script: bool = False,
        ranks: int | None = None,
        call: tuple[str, str, list[object]] | None = None,
    ) -> ForkedProcess:
        """``stderr`` None: into ``stdout``'s file, as ``stderr=subprocess.STDOUT``.
        ``script``: ``argv`` is a script and its arguments, run on ``ranks`` forked ranks if
        given. ``call``: (module, function, JSON arguments) to call on ``ranks`` ranks instead
        (``argv`` only names the command)."""
        assert self._server.stdin is not None
        for path in (stdout, stderr or stdout):
            path.write_bytes(b"")  # there when this returns, as Popen's stdout file is
        self._count += 1
        request = {
            "id": self._count, "argv": argv, "env": self.env if env is None else env,
            "cwd": str(cwd or Path.cwd()), "stdout": str(stdout), "stderr": str(stderr or stdout),
            "script": script, "ranks": ranks, "call": call,
        }  # fmt: skip
        self._server.stdin.write(json.dumps(request).encode() + b"\n")
        self._server.stdin.flush()
        pid = self._result(self._count, "pid", 60)
        if pid is None:
            raise subprocess.TimeoutExpired("the fork server", 60)
        return ForkedProcess(self, self._count, pid, [*([] if script else ["hpc-ddp"]), *argv])

    def run(
        self,
        argv: list[str],
        cwd: Path | None = None,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        script: bool = False,
        ranks: int | None = None,
    ) -> subprocess.CompletedProcess[str]:
        out, err = (self.scratch / f"{self._count + 1}.{name}" for name in ("out", "err"))
        proc = self.start(argv, out, err, cwd, env, script, ranks)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # as subprocess.run's timeout does; the server goes on
            proc.wait(60)
            raise subprocess.TimeoutExpired(proc.args, timeout) from None
        return subprocess.CompletedProcess(
            proc.args, rc, out.read_text(errors="replace"), err.read_text(errors="replace")
        )

    def _result(self, command_id: int, key: str, timeout: float | None) -> int | None:
        """Command ``command_id``'s ``key`` (pid or rc), reading the server's replies for at
        most ``timeout`` seconds (None: no limit); None if it has not come by then."""
        assert self._server.stdout is not None
        fd = self._server.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while (command_id, key) not in self._results:
            if b"\n" in self._replies:
                line, _, self._replies = self._replies.partition(b"\n")
                reply = json.loads(line)
                command = reply.pop("id")
                for name, value in reply.items():
                    self._results[(command, name)] = value
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)  # unbuffered, so that select sees what is not read yet
            if not chunk:
                raise RuntimeError(f"the fork server ended (exit {self._server.wait()})")
            self._replies += chunk
        return self._results[(command_id, key)]

    def close(self) -> None:
        """End the server: at the end of its input, once its children have exited, or killed
        with any it still waits on."""
        if self._server.stdin is not None and not self._server.stdin.closed:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self._server.pid, signal.SIGKILL)
            self._server.wait()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
