"""Run a scheduler-less launch and make every failure loud and bounded.

pdsh and clush alone are not enough: they wait for *all* hosts, so one failed host leaves the
others blocked (torchrun's exit barrier alone waits 300 s), and ``pdsh -S`` reports 0 when a
host's command was killed by a signal. So the runner reads the tools' output as it streams,
and at the first host failure it runs the stop command on every host (which ends each host's
recorded process group), waits a bounded time for the tool to return, and exits non-zero
naming the host. Ctrl-C / SIGTERM on the runner do the same.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from hpc_ddp.cluster.hostlist import expand_hostlist
from hpc_ddp.deploy.shell.spec import LaunchSpec
from hpc_ddp.deploy.shell.tool_argv import ToolCommand, launch_command, stop_command
from hpc_ddp.errors import ConfigError, HpcDdpError

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


def _first_failure(
    proc: subprocess.Popen[str], events: queue.Queue[HostFailure | None], streams: int
) -> HostFailure | None:
    """Block until a host fails (return it) or the tool is done (None).

    "Done" is both streams at EOF, or the tool exited and its pipes stayed open
    ``EOF_GRACE_S`` longer (a process it started still holds them; stop_all ends those).
    """
    exited_at: float | None = None
    while streams:
        try:
            event = events.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at > EOF_GRACE_S:
                    return None
            continue
        if event is None:
            streams -= 1
        else:
            return event
    return None


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
    """Run the stop script on every host (bounded by the tool's -u); its exit code."""
    out = out or sys.stderr
    require_tool(spec)
    cmd = stop_command(spec)
    proc = subprocess.run(
        list(cmd.argv),
        env={**os.environ, **dict(cmd.env)},
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=out,
        timeout=spec.stop_grace_s + 60,  # the tool's -u bounds it already; this is a backstop
        check=False,
    )
    return proc.returncode


def _stop_until_done(spec: LaunchSpec, proc: subprocess.Popen[str], deadline: float) -> None:
    """Stop every host, again every few seconds while the tool still runs, until the deadline.

    One pass is not enough: a host whose ssh connection was slower than the failure report may
    start its processes *after* the first stop found nothing there. Its processes carry the
    launch's tag, so the next pass ends them.
    """
    while time.monotonic() < deadline:
        stop_all(spec)
        try:
            proc.wait(timeout=min(STOP_REPEAT_S, max(0.0, deadline - time.monotonic())))
            return
        except subprocess.TimeoutExpired:
            continue


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def stop_hint(spec: LaunchSpec) -> str:
    """The exact ``hpc-ddp launch stop`` command for this launch."""
    state = ["--state-dir", spec.state_dir] if spec.state_dir else []  # else: each host's default
    return shlex.join(
        ["hpc-ddp", "launch", "stop", "--via", spec.tool, "--rcmd", spec.rcmd, "--hosts",
         ",".join(spec.hosts), "--launch-id", spec.launch_id, *state]
    )  # fmt: skip


def run_launch(spec: LaunchSpec, *, settle_s: float = 30.0) -> int:
    """Start the launch; return 0 only if every host's command exited 0."""
    require_tool(spec)
    cmd = launch_command(spec)
    print(
        f"{TAG} {spec.launch_id}: {spec.num_nodes} host(s) {','.join(spec.hosts)} x "
        f"{spec.nproc_per_node} process(es), {spec.mode}, master "
        f"{spec.master_addr}:{spec.master_port}\n{TAG} to stop it: {stop_hint(spec)}",
        file=sys.stderr,
        flush=True,
    )
    events: queue.Queue[HostFailure | None] = queue.Queue()
    proc = _start(cmd)
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [
        threading.Thread(target=_pump, args=(s, sink, events), daemon=True)
        for s, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
    ]
    for pump in pumps:
        pump.start()

    def on_signal(signum: int, _frame: object) -> None:
        raise _Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    failures: list[HostFailure] = []
    interrupted: int | None = None
    try:
        first = _first_failure(proc, events, len(pumps))
        if first:
            failures.append(first)
            print(
                f"{TAG} host {','.join(first.hosts)} failed (exit code {first.code}); "
                "stopping the job on every host",
                file=sys.stderr,
                flush=True,
            )
    except _Interrupted as sig:
        interrupted = sig.signum
        print(f"{TAG} got signal {sig.signum}; stopping the job on every host", file=sys.stderr)
    finally:
        # A second Ctrl-C during the stop must not leave hosts running: ignore it.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
    try:
        deadline = time.monotonic() + settle_s
        if failures or interrupted:
            _stop_until_done(spec, proc, deadline)
        elif any(pump.is_alive() for pump in pumps):
            print(f"{TAG} {spec.tool} exited but processes it started still hold its output; "
                  "stopping them", file=sys.stderr)  # fmt: skip
            stop_all(spec)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"{TAG} {spec.tool} still running {settle_s:.0f} s after stop; killing it",
                file=sys.stderr,
            )
            _kill_tree(proc, 5.0)
        for pump in pumps:
            pump.join(timeout=max(0.1, deadline - time.monotonic()))
        while True:  # failure lines that arrived after the first one
            try:
                event = events.get_nowait()
            except queue.Empty:
                break
            if event is not None:
                failures.append(event)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return _summarize(spec, proc.returncode, failures, interrupted)


def _summarize(
    spec: LaunchSpec, tool_rc: int | None, failures: list[HostFailure], interrupted: int | None
) -> int:
    if interrupted:
        return 128 + interrupted
    if failures:
        by_host: dict[str, int] = {}
        for failure in failures:
            for host in failure.hosts:
                by_host.setdefault(host, failure.code)
        listing = ", ".join(f"{h} (exit {c})" for h, c in by_host.items())
        print(f"{TAG} FAILED on {listing}; first: {failures[0].line}", file=sys.stderr)
        return failures[0].code if 0 < failures[0].code < 256 else 1
    if tool_rc:
        print(f"{TAG} {spec.tool} exited with code {tool_rc}", file=sys.stderr)
        return tool_rc
    print(f"{TAG} all {spec.num_nodes} host(s) finished with exit code 0", file=sys.stderr)
    return 0
