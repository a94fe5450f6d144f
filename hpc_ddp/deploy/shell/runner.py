"""Run a scheduler-less launch and make every failure loud and bounded.

pdsh and clush alone are not enough: they wait for *all* hosts, so one failed host leaves the
others blocked (torchrun's exit barrier alone waits 300 s), and ``pdsh -S`` reports 0 when a
host's command was killed by a signal. So ``ShellJob`` reads the tools' output as it streams,
and at the first host failure it runs the stop command on every host (which ends each host's
recorded process group), waits a bounded time for the tool to return, and ends non-zero naming
the host; ``cancel`` (the CLI's Ctrl-C / SIGTERM) does the same.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from hpc_ddp.cluster.hostlist import expand_hostlist
from hpc_ddp.deploy.backend import Finished, Job
from hpc_ddp.deploy.shell.spec import LaunchSpec
from hpc_ddp.deploy.shell.tool_argv import ToolCommand, launch_command, stop_command
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.run_dir.paths import RunPaths

TAG = "hpc-ddp launch:"
# The tools' own per-host failure lines (pdsh on stderr, clush on stderr; clush may fold hosts
# into a node set) and the host script's exit line (prefixed "host: " by the tool).
_PDSH = re.compile(
    r"^pdsh@\S+: (?P<hosts>[^\s:]+): (?:\S+ exited with exit code (?P<code>\d+)"
    r"|\S+ killed by signal (?P<sig>\d+)|(?P<timeout>command timeout))"
)
_CLUSH = re.compile(
    r"^clush: (?P<hosts>\S+): (?:exited with exit code (?P<code>\d+)"
    r"|killed by signal (?P<sig>\d+)|(?P<timeout>command timeout))"
)
_SCRIPT = re.compile(r"^(?P<hosts>\S+): hpc-ddp-launch: host=\S+ node_rank=\d+ exit=(?P<code>\d+)")
TIMEOUT_CODE = 124  # what timeout(1) returns
SSH_FAILED_CODE = 255  # what ssh returns when it cannot connect or log in
STOP_REPEAT_S = 3.0
EOF_GRACE_S = 5.0


@dataclass(frozen=True)
class HostFailure:
    hosts: tuple[str, ...]
    code: int
    line: str


def parse_failure(line: str) -> HostFailure | None:
    """A HostFailure if ``line`` reports a host whose command failed, else None."""
    for pattern in (_PDSH, _CLUSH, _SCRIPT):
        match = pattern.match(line)
        if not match:
            continue
        groups = match.groupdict()
        if groups.get("timeout"):
            code = TIMEOUT_CODE
        elif groups.get("sig"):
            code = 128 + int(groups["sig"])
        else:
            code = int(groups["code"])
        if code == 0:
            return None
        try:
            hosts = tuple(expand_hostlist(match.group("hosts")))
        except HpcDdpError:
            hosts = (match.group("hosts"),)
        return HostFailure(hosts, code, line)
    return None


def _is_this_machine(host: str) -> bool:
    """``host`` names the machine the launch runs on: localhost, a loopback address, or this
    host's own name (what a user types to try a launch on one machine)."""
    own = socket.gethostname()
    if host in ("localhost", "localhost.localdomain", own, own.split(".")[0]):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ssh_failure_hint(hosts: list[str]) -> str:
    """What to do about ``hosts`` whose ssh exited SSH_FAILED_CODE: a launch on this machine
    needs no ssh at all (``--rcmd exec``); real hosts need ssh that works without a prompt."""
    text = (
        f"exit {SSH_FAILED_CODE} is ssh's own: it could not connect or log in to "
        f"{', '.join(hosts)} (its message is above)"
    )
    local = [h for h in hosts if _is_this_machine(h)]
    if local:
        return (
            f"{text}; {', '.join(local)} is this machine: pass --rcmd exec to run a launch here "
            "without ssh (docs/no-scheduler.md)"
        )
    return (
        f"{text}; check that `ssh -oBatchMode=yes HOST true` works without a prompt "
        "(docs/no-scheduler.md#ssh-settings), or pass --rcmd exec to run every host's command "
        "on this machine"
    )


def _pump(stream: IO[str], sink: IO[str], events: queue.Queue[HostFailure | None]) -> None:
    """Copy a tool stream line by line to ours, reporting failure lines; None at EOF.

    Keeps draining even if our own output is gone (``| head``): a full pipe would block the
    tool, and the EOF event must always come.
    """
    try:
        for line in stream:
            with contextlib.suppress(OSError, ValueError):
                sink.write(line)
                sink.flush()
            failure = parse_failure(line.rstrip("\n"))
            if failure:
                events.put(failure)
    finally:
        events.put(None)


def require_tool(spec: LaunchSpec) -> None:
    if shutil.which(spec.tool_exe) is None:
        raise ConfigError(
            f"{spec.tool_exe!r} is not installed here (not found on PATH)",
            hint="install it (Debian/Ubuntu: apt-get install pdsh clustershell; or pip install "
            "clustershell), use the other tool, or pass --tool-path",
        )


def _start(cmd: ToolCommand) -> subprocess.Popen[str]:
    return subprocess.Popen(
        list(cmd.argv),
        env={**os.environ, **dict(cmd.env)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        start_new_session=True,  # our signal handling decides what the tool gets
    )


def _kill_tree(proc: subprocess.Popen[str], grace_s: float) -> None:
    """End the local tool (and its ssh/exec children): TERM its session, then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue


def stop_all(spec: LaunchSpec, out: IO[str] | None = None) -> int:
    """Run the stop script on every host (bounded by the tool's -u); its exit code. What the
    hosts print goes to ``out`` (default: stderr) once the stop has ended."""
    require_tool(spec)
    cmd = stop_command(spec)
    proc = subprocess.run(
        list(cmd.argv),
        env={**os.environ, **dict(cmd.env)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=spec.stop_grace_s + 60,  # the tool's -u bounds it already; this is a backstop
        check=False,
    )
    with contextlib.suppress(OSError, ValueError):  # our own output may be gone (| head)
        (out or sys.stderr).write(proc.stdout)
        (out or sys.stderr).flush()
    return proc.returncode


def _stop_until_done(
    spec: LaunchSpec, proc: subprocess.Popen[str], deadline: float, out: IO[str] | None = None
) -> None:
    """Stop every host, again every few seconds while the tool still runs, until the deadline.

    One pass is not enough: a host whose ssh connection was slower than the failure report may
    start its processes *after* the first stop found nothing there. Its processes carry the
    launch's tag, so the next pass ends them.
    """
    while time.monotonic() < deadline:
        stop_all(spec, out)
        try:
            proc.wait(timeout=min(STOP_REPEAT_S, max(0.0, deadline - time.monotonic())))
            return
        except subprocess.TimeoutExpired:
            continue


class _Deadline(Exception):
    pass


def stop_hint(spec: LaunchSpec) -> str:
    """The exact ``hpc-ddp launch stop`` command for this launch."""
    state = ["--state-dir", spec.state_dir] if spec.state_dir else []  # else: each host's default
    return shlex.join(
        ["hpc-ddp", "launch", "stop", "--via", spec.tool, "--rcmd", spec.rcmd, "--hosts",
         ",".join(spec.hosts), "--launch-id", spec.launch_id, *state]
    )  # fmt: skip


class ShellJob(Job):
    """A running pdsh/clush launch: the tool's output is copied to ``stdout``/``stderr`` as it
    streams (None: dropped), and read for failed hosts. ``job_id`` is the launch id."""

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        settle_s: float = 30.0,
        run_paths: RunPaths | None = None,
    ) -> None:
        require_tool(spec)
        self.spec, self.executor, self.job_id = spec, spec.tool, spec.launch_id
        self.run_paths = run_paths
        self.program = spec.program_module
        self.settle_s = settle_s
        self.settling = False  # True once the launch is being stopped or collected
        # The pipes are always drained (a full pipe would block the tool): None = dropped.
        self._devnull = open(os.devnull, "w") if None in (stdout, stderr) else None  # noqa: SIM115
        self._out = stdout or self._devnull
        self._err = stderr or self._devnull
        self._say(
            f"{spec.launch_id}: {spec.num_nodes} host(s) {','.join(spec.hosts)} x "
            f"{spec.nproc_per_node} process(es), {spec.mode}, master "
            f"{spec.master_addr}:{spec.master_port}\n{TAG} to stop it: {stop_hint(spec)}"
        )
        self._events: queue.Queue[HostFailure | None] = queue.Queue()
        self._failures: list[HostFailure] = []
        self._finished: Finished | None = None
        self._proc = _start(launch_command(spec))
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._pumps = [
            threading.Thread(target=_pump, args=(stream, sink, self._events), daemon=True)
            for stream, sink in ((self._proc.stdout, self._out), (self._proc.stderr, self._err))
        ]
        self._open_streams = len(self._pumps)
        for pump in self._pumps:
            pump.start()

    def _say(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(f"{TAG} {text}", file=self._err, flush=True)

    def status(self) -> str:
        if self._finished is not None:
            return self._finished.state
        return "RUNNING" if self._proc.poll() is None else "COMPLETING"

    def wait(self, timeout_s: float | None = None) -> Finished:
        if self._finished is not None:
            return self._finished
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            first = self._first_failure(deadline)
        except _Deadline:
            self._say(f"still running after {timeout_s:.0f} s; stopping the job on every host")
            self._end(stop=True, state="TIMEOUT", code=TIMEOUT_CODE)
            raise HpcDdpError(
                f"launch {self.job_id} still running after {timeout_s:.0f} s: stopped it",
                hint="wait longer, or bound each host's command with --timeout",
            ) from None
        if first is not None:
            self._failures.append(first)
            self._say(
                f"host {','.join(first.hosts)} failed (exit code {first.code}); "
                "stopping the job on every host"
            )
        return self._end(stop=first is not None)

    def cancel(self, *, signum: int | None = None) -> None:
        """Stop every host; ``signum``: the signal that asked for it (the exit code is 128+N)."""
        if self._finished is None:
            code = 128 + signum if signum else 128 + signal.SIGTERM
            self._end(stop=True, state="CANCELLED", code=code)

    def _first_failure(self, deadline: float | None) -> HostFailure | None:
        """Block until a host fails (return it) or the tool is done (None).

        "Done" is both streams at EOF, or the tool exited and its pipes stayed open
        ``EOF_GRACE_S`` longer (a process it started still holds them; stop_all ends those).
        """
        exited_at: float | None = None
        while self._open_streams:
            if deadline is not None and time.monotonic() > deadline:
                raise _Deadline
            try:
                event = self._events.get(timeout=0.5)
            except queue.Empty:
                if self._proc.poll() is not None:
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > EOF_GRACE_S:
                        return None
                continue
            if event is None:
                self._open_streams -= 1
            else:
                return event
        return None

    def _end(self, *, stop: bool, state: str | None = None, code: int | None = None) -> Finished:
        """Stop the hosts if asked, collect the tool and its late failure lines, summarize."""
        self.settling = True
        proc, deadline = self._proc, time.monotonic() + self.settle_s
        if stop:
            _stop_until_done(self.spec, proc, deadline, self._err)
        elif any(pump.is_alive() for pump in self._pumps):
            self._say(f"{self.spec.tool} exited but processes it started still hold its output; "
                      "stopping them")  # fmt: skip
            stop_all(self.spec, self._err)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            tool, grace = self.spec.tool, self.settle_s
            self._say(f"{tool} still running {grace:.0f} s after stop; killing it")
            _kill_tree(proc, 5.0)
        for pump in self._pumps:
            pump.join(timeout=max(0.1, deadline - time.monotonic()))
        while True:  # failure lines that arrived after the first one
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event is not None:
                self._failures.append(event)
        if code is None:
            code = self._summarize(proc.returncode)
        state = state or ("COMPLETED" if code == 0 else "FAILED")
        failed = sorted({host for failure in self._failures for host in failure.hosts})
        error = f"failed on {', '.join(failed)}" if failed else ""
        self._finished = Finished(self.job_id, state, code, error=error)
        if self._devnull is not None:
            self._devnull.close()
        return self._finished

    def _summarize(self, tool_rc: int | None) -> int:
        if self._failures:
            by_host: dict[str, int] = {}
            for failure in self._failures:
                for host in failure.hosts:
                    by_host.setdefault(host, failure.code)
            listing = ", ".join(f"{h} (exit {c})" for h, c in by_host.items())
            self._say(f"FAILED on {listing}; first: {self._failures[0].line}")
            unreached = [h for h, c in by_host.items() if c == SSH_FAILED_CODE]
            if unreached and self.spec.rcmd == "ssh":
                self._say(f"HINT: {_ssh_failure_hint(unreached)}")
            first = self._failures[0].code
            return first if 0 < first < 256 else 1
        if tool_rc:
            self._say(f"{self.spec.tool} exited with code {tool_rc}")
            return tool_rc
        self._say(f"all {self.spec.num_nodes} host(s) finished with exit code 0")
        return 0
