"""The bash that runs on each host of a scheduler-less launch, and the bash that stops it.

Text with two placeholders, ``%h`` (host) and ``%n`` (node rank), which pdsh and clush
substitute; every other ``%`` is doubled because both tools substitute ``%``. The scripts need
only bash, coreutils, grep and sed on the hosts (and python for the payload).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_ddp.deploy.shell_launch import LaunchSpec

# Exit codes of the host script itself (the payload's own codes pass through unchanged).
EXIT_WRONG_RANK = 97  # %n does not name the host the canonical order puts there
EXIT_NO_WORKDIR = 96
EXIT_SETUP_FAILED = 95

_H, _N = "\x00H", "\x00N"  # sentinels for %h / %n while the rest of the text gets escaped


def _finish(lines: list[str]) -> str:
    """Join, double every literal '%', then turn the sentinels into pdsh/clush placeholders."""
    return "\n".join(lines).replace("%", "%%").replace(_H, "%h").replace(_N, "%n") + "\n"


def payload_argv(spec: LaunchSpec) -> list[str]:
    """What the host script starts in its own session: torchrun or the node agent."""
    if spec.mode == "torchrun":
        return [
            spec.python,
            "-m",
            "torch.distributed.run",  # == torchrun, but needs no console script on PATH
            f"--nnodes={spec.num_nodes}",
            f"--node-rank={_N}",
            f"--nproc-per-node={spec.nproc_per_node}",
            f"--master-addr={spec.master_addr}",
            f"--master-port={spec.master_port}",
            "--max-restarts=0",  # a failed rank fails the launch; restarts belong to requeue
            "--monitor-interval=0.5",
            # static rendezvous: how long a node waits for the master's store before giving up
            f"--rdzv-conf=timeout={spec.rendezvous_timeout_s}",
            "--no-python",
            *spec.command,
        ]
    return [
        spec.python,
        "-m",
        "hpc_ddp.deploy.node_agent",
        f"--nproc={spec.nproc_per_node}",
        f"--grace={spec.stop_grace_s}",
        "--",
        *spec.command,
    ]


def host_script(spec: LaunchSpec) -> str:
    """The bash text every host runs: check rank, cd, export, set up, start, record, wait."""
    q = shlex.quote
    launcher_env: list[tuple[str, str]] = [
        ("HPC_DDP_LAUNCH_ID", spec.launch_id),
        ("HPC_DDP_LAUNCH_TAG", f"{spec.launch_id}/{_H}"),  # what `stop` looks for (per host)
        # detect_env's default for gpus_per_process (the trainer reads it), in both modes
        ("HPC_DDP_GPUS_PER_PROCESS", str(spec.gpus_per_process)),
    ]
    if spec.mode == "processes":
        # The contract of hpc_ddp.cluster.launcher; the node agent adds HPC_DDP_LOCAL_RANK.
        launcher_env += [
            ("HPC_DDP_LAUNCHER", spec.tool),
            ("HPC_DDP_JOB_ID", spec.launch_id),
            ("HPC_DDP_NUM_NODES", str(spec.num_nodes)),
            ("HPC_DDP_NODE_RANK", _N),
            ("HPC_DDP_LOCAL_WORLD_SIZE", str(spec.nproc_per_node)),
            ("HPC_DDP_MASTER_ADDR", spec.master_addr),
            ("HPC_DDP_MASTER_PORT", str(spec.master_port)),
        ]
    tag = "hpc-ddp-launch:"
    lines = [
        f"# hpc-ddp launch {spec.launch_id}: host script; %h = this host, %n = its node rank",
        f"host={_H}",
        f"node_rank={_N}",
        f"hosts=({' '.join(q(h) for h in spec.hosts)})",
        'if [ "${hosts[$node_rank]:-}" != "$host" ]; then',
        f'  echo "{tag} host $host got node rank $node_rank, but the launch order '
        f'{",".join(spec.hosts)} puts ${{hosts[$node_rank]:-no host}} there" >&2',
        f"  exit {EXIT_WRONG_RANK}",
        "fi",
        f'cd {q(spec.workdir)} || {{ echo "{tag} $host: cannot cd to" {q(spec.workdir)} >&2;'
        f" exit {EXIT_NO_WORKDIR}; }}",
    ]
    lines += [f"export {k}={q(v)}" for k, v in spec.env]
    for step in spec.setup:
        lines.append(
            f'{{ {step}\n}} || {{ echo "{tag} $host: setup step failed:" {q(step)} >&2;'
            f" exit {EXIT_SETUP_FAILED}; }}"
        )
    lines += [f"export {k}={q(v)}" for k, v in launcher_env]
    pidfile = f'{q(spec.launch_dir)}/"$host".pgid'
    lines += [
        f"mkdir -p {q(spec.launch_dir)} || exit 1",
        # Own session: its process group id is its pid, recorded so `hpc-ddp launch stop`
        # (or the launcher, when another host fails) can end everything it started here.
        f"setsid {shlex.join(payload_argv(spec))} </dev/null &",
        "pid=$!",
        # mkdir again: another "host" sharing this dir may have just removed it (rmdir below)
        f'mkdir -p {q(spec.launch_dir)}; echo "$pid" > {pidfile}',
        "trap 'kill -TERM -- -$pid 2>/dev/null' TERM INT HUP",
        'wait "$pid"; rc=$?',
        # a trapped signal interrupts wait: keep waiting for the real exit code
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
        f"rm -f {pidfile}",
        f"rmdir --ignore-fail-on-non-empty {q(spec.launch_dir)} 2>/dev/null",
        f'echo "{tag} host=$host node_rank=$node_rank exit=$rc" >&2',
        "exit $rc",
    ]
    return _finish(lines)


def stop_script(spec: LaunchSpec) -> str:
    """Bash for every host: end every process this launch started there, TERM then KILL.

    What to end is found two ways. (1) Every process the host script started inherits
    ``HPC_DDP_LAUNCH_TAG=<id>/<host>``: one ``grep -z`` over /proc/*/environ finds them, even
    torchrun's workers, which torchrun puts in sessions of their own (so killing torchrun's
    process group alone would orphan them if torchrun had to be SIGKILLed). (2) The process
    group recorded in the pid file, for a child that cleared its environment. A pid file can
    outlive its launch; if its leader exists but lacks the tag, the pid was reused: left alone.
    While any member of a group lives, Linux does not reuse its id, so ``-pgid`` is safe.
    """
    q = shlex.quote
    tag = "hpc-ddp-launch-stop:"
    pidfile = f'{q(spec.launch_dir)}/"$host".pgid'
    ticks = max(1, spec.stop_grace_s * 10)
    lines = [
        f"host={_H}",
        f'marker="HPC_DDP_LAUNCH_TAG={spec.launch_id}/$host"',
        # pids whose environment carries the marker (zombies have an empty environ: skipped)
        "ours() {",
        '  grep -lzxF "$marker" /proc/[0-9]*/environ 2>/dev/null'
        " | sed -e 's#^/proc/##' -e 's#/environ$##' | grep -vx \"$$\"",
        "}",
        "pg=",
        f"[ -f {pidfile} ] && pg=$(cat {pidfile})",
        # Unreadable environ = the leader is gone; its group may live on: keep pg.
        "if [ -n \"$pg\" ] && leader_env=$( { tr '\\0' '\\n' < \"/proc/$pg/environ\"; }"
        " 2>/dev/null ); then",
        '  printf "%s\\n" "$leader_env" | grep -qxF "$marker" || pg=',
        "fi",
        "targets=$(ours)",
        'if [ -z "$targets" ] && ! { [ -n "$pg" ] && kill -0 -- "-$pg" 2>/dev/null; }; then',
        f'  rm -f {pidfile}; echo "{tag} $host: nothing running"; exit 0',
        "fi",
        'if [ -n "$pg" ]; then kill -TERM -- "-$pg" 2>/dev/null; fi',
        "kill -TERM $targets 2>/dev/null",
        f"for _ in $(seq {ticks}); do",
        "  targets=$(ours)",
        '  if [ -z "$targets" ] && ! { [ -n "$pg" ] && kill -0 -- "-$pg" 2>/dev/null; }; then',
        f'    rm -f {pidfile}; echo "{tag} $host: stopped"; exit 0',
        "  fi",
        "  sleep 0.1",
        "done",
        'if [ -n "$pg" ]; then kill -KILL -- "-$pg" 2>/dev/null; fi',
        "kill -KILL $(ours) 2>/dev/null",
        f"rm -f {pidfile}",
        f'echo "{tag} $host: killed (still running {spec.stop_grace_s} s after SIGTERM)"',
    ]
    return _finish(lines)
