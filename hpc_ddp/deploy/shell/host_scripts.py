"""The bash that runs on each host of a scheduler-less launch, and the bash that stops it.

Text with two placeholders, ``%h`` (host) and ``%n`` (node rank), which pdsh and clush
substitute; every other ``%`` is doubled because both tools substitute ``%``. The scripts need
only bash, coreutils, grep and sed on the hosts (and python for the payload).
"""

from __future__ import annotations

import shlex

from hpc_ddp.deploy.container import apptainer_env_lines, apptainer_exec_argv
from hpc_ddp.deploy.shell.spec import LaunchSpec
from hpc_ddp.env_vars import LAUNCH_TAG_VAR, launch_environ
from hpc_ddp.private_paths import SHELL_FUNCTIONS

# Exit codes of the host script itself (the payload's own codes pass through unchanged).
EXIT_WRONG_RANK = 97  # %n does not name the host the canonical order puts there
EXIT_NO_WORKDIR = 96
EXIT_SETUP_FAILED = 95
EXIT_STATE_DIR = 94  # no private directory for the pid files

_H, _N = "\x00H", "\x00N"  # sentinels for %h / %n while the rest of the text gets escaped


def _state_lines(spec: LaunchSpec) -> list[str]:
    """Bash that sets ``$state`` (the pid files' directory) and ``$launch_dir``, ``$pidfile``.

    The default is resolved on the host, by the rules of hpc_ddp.private_paths: a path from
    the launching machine (its XDG_RUNTIME_DIR, its user) may not exist or be ours there.
    Resolved before ``cd`` and the exports, so that the stop script finds the same directory.
    """
    state = shlex.quote(spec.state_dir) if spec.state_dir else '"$(hpc_ddp_state_base)/launch"'
    return [
        *SHELL_FUNCTIONS.strip().splitlines(),
        f"state={state}",
        f'launch_dir="$state"/{shlex.quote(spec.launch_id)}',
        'pidfile="$launch_dir/$host.pgid"',
    ]


def _finish(lines: list[str]) -> str:
    """Join, double every literal '%', then turn the sentinels into pdsh/clush placeholders."""
    return "\n".join(lines).replace("%", "%%").replace(_H, "%h").replace(_N, "%n") + "\n"


def payload_argv(spec: LaunchSpec) -> list[str]:
    """What the host script starts in its own session: torchrun or the node agent, in the
    container image when the launch names one (apptainer exec in front)."""
    return [*_container_exec(spec), *_payload(spec)]


def _container_exec(spec: LaunchSpec) -> list[str]:
    if spec.container is None:
        return []
    # --gpus-per-node counts process slots even on CPU-only hosts, so GPUs are not known here:
    # --nv always (apptainer only warns where it finds no NVIDIA driver).
    return apptainer_exec_argv(spec.container, gpus=True)


def _payload(spec: LaunchSpec) -> list[str]:
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
        "hpc_ddp.deploy.shell.node_agent",
        f"--nproc={spec.nproc_per_node}",
        f"--grace={spec.stop_grace_s}",
        "--",
        *spec.command,
    ]


def host_script(spec: LaunchSpec) -> str:
    """The bash text every host runs: check rank and state dir, cd, export, set up, start,
    record, wait."""
    q = shlex.quote
    contract_env = launch_environ(
        launch_id=spec.launch_id,
        launch_tag=f"{spec.launch_id}/{_H}",  # what `stop` looks for (per host)
        # detect_env's default for gpus_per_process (the trainer reads it), in both modes
        gpus_per_process=spec.gpus_per_process,
    )
    if spec.mode == "processes":
        # The rest of the contract; the node agent adds the local rank. (Under torchrun,
        # torchrun gives its workers their places.)
        contract_env |= launch_environ(
            started_by=spec.tool,
            job_id=spec.launch_id,
            num_nodes=spec.num_nodes,
            node_rank=_N,
            local_world_size=spec.nproc_per_node,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
        )
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
        *_state_lines(spec),
        # Every level from the toolkit's own directory down: 0700, ours, nobody else's.
        *([] if spec.state_dir else ['hpc_ddp_private_dir "$(dirname -- "$state")" &&']),
        'hpc_ddp_private_dir "$state" && hpc_ddp_private_dir "$launch_dir" || {',
        f'  echo "{tag} $host: no private directory for the pid files; fix the one above or'
        ' pass --state-dir DIR (a directory only you can write)" >&2',
        f"  exit {EXIT_STATE_DIR}",
        "}",
        f'cd {q(spec.workdir)} || {{ echo "{tag} $host: cannot cd to" {q(spec.workdir)} >&2;'
        f" exit {EXIT_NO_WORKDIR}; }}",
    ]
    lines += [f"export {k}={q(v)}" for k, v in spec.env.items()]
    for step in spec.setup:
        lines.append(
            f'{{ {step}\n}} || {{ echo "{tag} $host: setup step failed:" {q(step)} >&2;'
            f" exit {EXIT_SETUP_FAILED}; }}"
        )
    lines += [f"export {k}={q(v)}" for k, v in contract_env.items()]
    if spec.container is not None:  # host values that win over the image's
        lines += apptainer_env_lines(spec.container)
    lines += [
        # Own session: its process group id is its pid, recorded so `hpc-ddp launch stop`
        # (or the launcher, when another host fails) can end everything it started here.
        f"setsid {shlex.join(payload_argv(spec))} </dev/null &",
        "pid=$!",
        # mkdir again: another "host" sharing this dir may have just removed it (rmdir below).
        # The pid goes to a new file (mktemp: O_EXCL) renamed over the pid file's name, so a
        # link planted at that name is replaced, never written through.
        'mkdir -p -m 0700 -- "$launch_dir"',
        'tmp=$(mktemp -- "$launch_dir/.$host.pgid.XXXXXX") && echo "$pid" > "$tmp" &&'
        ' mv -fT -- "$tmp" "$pidfile" ||'
        f' echo "{tag} $host: could not record the process group in $launch_dir" >&2',
        "trap 'kill -TERM -- -$pid 2>/dev/null' TERM INT HUP",
        'wait "$pid"; rc=$?',
        # a trapped signal interrupts wait: keep waiting for the real exit code
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
        'rm -f -- "$pidfile"',
        'rmdir --ignore-fail-on-non-empty -- "$launch_dir" 2>/dev/null',
        f'echo "{tag} host=$host node_rank=$node_rank exit=$rc" >&2',
        "exit $rc",
    ]
    return _finish(lines)


def stop_script(spec: LaunchSpec) -> str:
    """Bash for every host: end every process this launch started there, TERM then KILL.

    What to end is found two ways. (1) Every process the host script started inherits
    the launch tag ``<id>/<host>``: one ``grep -z`` over /proc/*/environ finds them, even
    torchrun's workers, which torchrun puts in sessions of their own (so killing torchrun's
    process group alone would orphan them if torchrun had to be SIGKILLed). (2) The process
    group recorded in the pid file, for a child that cleared its environment. A pid file can
    outlive its launch; if its leader exists but lacks the tag, the pid was reused: left alone.
    While any member of a group lives, Linux does not reuse its id, so ``-pgid`` is safe.
    """
    tag = "hpc-ddp-launch-stop:"
    ticks = max(1, spec.stop_grace_s * 10)
    lines = [
        f"host={_H}",
        *_state_lines(spec),
        f'marker="{LAUNCH_TAG_VAR}={spec.launch_id}/$host"',
        # pids whose environment carries the marker (zombies have an empty environ: skipped)
        "ours() {",
        '  grep -lzxF "$marker" /proc/[0-9]*/environ 2>/dev/null'
        " | sed -e 's#^/proc/##' -e 's#/environ$##' | grep -vx \"$$\"",
        "}",
        # The pid file only from a private state dir, never through a link, digits only.
        "pg=",
        'if ! hpc_ddp_not_private "$state" >/dev/null && [ -f "$pidfile" ] && [ ! -L "$pidfile" ]',
        'then pg=$(cat -- "$pidfile"); [[ $pg =~ ^[0-9]+$ ]] || pg=; else pidfile=; fi',
        'drop_pidfile() { [ -z "$pidfile" ] || rm -f -- "$pidfile"; }',
        # Unreadable environ = the leader is gone; its group may live on: keep pg.
        "if [ -n \"$pg\" ] && leader_env=$( { tr '\\0' '\\n' < \"/proc/$pg/environ\"; }"
        " 2>/dev/null ); then",
        '  printf "%s\\n" "$leader_env" | grep -qxF "$marker" || pg=',
        "fi",
        "targets=$(ours)",
        'if [ -z "$targets" ] && ! { [ -n "$pg" ] && kill -0 -- "-$pg" 2>/dev/null; }; then',
        f'  drop_pidfile; echo "{tag} $host: nothing running"; exit 0',
        "fi",
        'if [ -n "$pg" ]; then kill -TERM -- "-$pg" 2>/dev/null; fi',
        "kill -TERM $targets 2>/dev/null",
        f"for _ in $(seq {ticks}); do",
        "  targets=$(ours)",
        '  if [ -z "$targets" ] && ! { [ -n "$pg" ] && kill -0 -- "-$pg" 2>/dev/null; }; then',
        f'    drop_pidfile; echo "{tag} $host: stopped"; exit 0',
        "  fi",
        "  sleep 0.1",
        "done",
        'if [ -n "$pg" ]; then kill -KILL -- "-$pg" 2>/dev/null; fi',
        "kill -KILL $(ours) 2>/dev/null",
        "drop_pidfile",
        f'echo "{tag} $host: killed (still running {spec.stop_grace_s} s after SIGTERM)"',
    ]
    return _finish(lines)
