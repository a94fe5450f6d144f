"""``hpc-ddp launch pdsh|clush|stop``: run a DDP job on hosts that have ssh but no scheduler.

    hpc-ddp launch pdsh --hosts 'node[01-02]' --gpus-per-node 8 -- --epochs 10 --run-dir runs/a
    hpc-ddp launch clush --hosts 'node[01-02]' --mode processes -- python3 my_worker.py
    hpc-ddp launch stop --hosts 'node[01-02]' --launch-id 20261126-011400-a1b2c3

Node rank = position of the host in SORTED order (clush's order; pdsh is given that order).
After '--': a command, or arguments for the trainer if the first one is an option.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from hpc_ddp import schema
from hpc_ddp.deploy.container import ContainerSpec
from hpc_ddp.deploy.script_file import write_atomic
from hpc_ddp.deploy.shell.backend import ShellBackend
from hpc_ddp.deploy.shell.runner import TAG
from hpc_ddp.deploy.shell.spec import MODES, RCMDS, TOOLS, LaunchSpec, make_spec
from hpc_ddp.deploy.shell.tool_argv import stop_command
from hpc_ddp.errors import ConfigError

ACTIONS = (*TOOLS, "stop")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("action", choices=ACTIONS, help="the tool to launch with, or stop")
    parser.add_argument("--hosts", required=True, help="host list, e.g. 'node[01-04],gpu7'")
    parser.add_argument(
        "--gpus-per-node",
        type=schema.flag_type(LaunchSpec, "gpus_per_node"),
        default=1,
        help="GPUs per host (process slots on CPU-only hosts)",
    )
    parser.add_argument(
        "--gpus-per-process",
        type=schema.flag_type(LaunchSpec, "gpus_per_process"),
        default=None,
        help="1: one process per GPU; G: one process drives G GPUs (default or 0: what --env "
        "sets, else 1)",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="torchrun",
        help="one torchrun per host, or one process per slot via the node agent",
    )
    parser.add_argument(
        "--rcmd",
        choices=RCMDS,
        default="ssh",
        help="ssh to real hosts; exec runs every 'host' on this machine (a launch on "
        "localhost needs exec unless an sshd there accepts your key)",
    )
    parser.add_argument("--master-addr", help="default: first host (127.0.0.1 with --rcmd exec)")
    parser.add_argument(
        "--master-port",
        type=schema.flag_type(LaunchSpec, "master_port"),
        help="default: derived from the launch id (hpc_ddp.cluster.master_port)",
    )
    parser.add_argument("--launch-id", help="name of this launch (pid files, port); default: new")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="export on every host (repeatable)",
    )
    parser.add_argument(
        "--no-forward-env",
        action="store_true",
        help="do not export this shell's NCCL_*/GLOO_*/PYTHONPATH/OMP_NUM_THREADS",
    )
    parser.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="SHELL",
        help="shell line run on every host first, e.g. 'source venv/bin/activate'",
    )
    parser.add_argument("--workdir", help="directory on every host (default: this one)")
    parser.add_argument(
        "--python", help="python on the hosts (default: this one, path shared with the hosts)"
    )
    parser.add_argument(
        "--state-dir",
        help="dir for pid files on every host, only yours (default: each host's "
        "$XDG_RUNTIME_DIR/hpc-ddp/launch, else ~/.local/state/hpc-ddp/launch)",
    )
    parser.add_argument(
        "--timeout",
        type=schema.flag_type(LaunchSpec, "timeout_s"),
        help="pdsh/clush -u: kill a host's command after N s",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=schema.flag_type(LaunchSpec, "rendezvous_timeout_s"),
        default=120,
        help="seconds a node waits for the master's store (torchrun mode)",
    )
    parser.add_argument(
        "--stop-grace",
        type=schema.flag_type(LaunchSpec, "stop_grace_s"),
        default=10,
        help="SIGTERM -> SIGKILL seconds",
    )
    parser.add_argument("--tool-path", help="pdsh/clush executable (default: from PATH)")
    parser.add_argument("--via", choices=TOOLS, default="pdsh", help="tool that runs `stop`")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the exact command, run nothing"
    )
    parser.add_argument(
        "--render-script",
        type=Path,
        metavar="FILE",
        help="write a standalone bash script of this launch and exit",
    )
    parser.add_argument(
        "--force", action="store_true", help="with --render-script: overwrite an existing FILE"
    )
    # --container-image and the rest: the job spec's [container] table (apptainer only here)
    schema.add_table_arguments(parser, "container", ContainerSpec)
    parser.usage = "hpc-ddp launch {pdsh,clush,stop} --hosts HOSTS [options] [-- COMMAND...]"
    # argparse cannot take options, then '--', then a command whose own options it must not
    # read (a positional after '--' is "unrecognized"); so split at the first '--' ourselves.
    parser.parse_args = _parse_with_command(parser.parse_args)  # type: ignore[method-assign]


def _parse_with_command(
    parse: Callable[..., argparse.Namespace],
) -> Callable[..., argparse.Namespace]:
    def parse_args(
        args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        args = list(sys.argv[1:] if args is None else args)
        cut = args.index("--") if "--" in args else len(args)
        ns = parse(args[:cut], namespace)
        ns.command = args[cut + 1 :]
        return ns

    return parse_args


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {pair!r} is not K=V", hint="e.g. --env NCCL_DEBUG=INFO")
        env[key] = value
    return env


def _container(args: argparse.Namespace) -> ContainerSpec | None:
    """The --container-* flags as a ContainerSpec (checked with the launch), or None."""
    given = schema.given_table(args, "container", ContainerSpec)
    if not given:
        return None
    return ContainerSpec(**schema.from_mapping(ContainerSpec, given, source="--container-*"))


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    stopping = args.action == "stop"
    if stopping:
        if not args.launch_id:
            raise ConfigError("stop needs --launch-id", hint="the launch printed it when it began")
        command = ["true"]  # the spec wants a command; stop never runs it
    spec = make_spec(
        tool=args.via if stopping else args.action,
        hosts=args.hosts,
        command=command,
        rcmd=args.rcmd,
        master_addr=args.master_addr,
        master_port=args.master_port,
        launch_id=args.launch_id,
        env=_parse_env(args.env),
        forward_env=not args.no_forward_env,
        python=args.python,
        workdir=args.workdir,
        state_dir=args.state_dir,
        gpus_per_node=args.gpus_per_node,
        gpus_per_process=args.gpus_per_process,
        mode=args.mode,
        setup=args.setup,
        timeout_s=args.timeout,
        rendezvous_timeout_s=args.rendezvous_timeout,
        stop_grace_s=args.stop_grace,
        tool_path=args.tool_path,
        container=_container(args),
    )
    if stopping:
        from hpc_ddp.deploy.shell.runner import stop_all

        if args.dry_run:
            print(stop_command(spec).shell())
            return 0
        return stop_all(spec, out=sys.stdout)
    if args.render_script or args.dry_run:
        return _describe(args, spec)
    return _run(spec)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _run(spec: LaunchSpec) -> int:
    """The launch, its tools' output on ours; Ctrl-C / SIGTERM stop every host (a second one
    during the stop is ignored). 0 only if every host's command exited 0."""
    backend = ShellBackend(stdout=sys.stdout, stderr=sys.stderr)
    job = backend.submit(backend.describe(spec))

    def on_signal(signum: int, _frame: object) -> None:
        if not job.settling:
            raise _Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            return job.wait().exit_code
        except _Interrupted as sig:
            print(f"{TAG} got signal {sig.signum}; stopping the job on every host", file=sys.stderr)
            job.cancel(signum=sig.signum)
            return job.wait().exit_code
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _describe(args: argparse.Namespace, spec: LaunchSpec) -> int:
    """--render-script writes the launch script, --dry-run prints its one command line: both
    are the backend's description of the launch, and nothing runs."""
    invoked = sys.argv[1:2] == ["launch"]  # else we were called as a library (tests)
    produced_by = "hpc-ddp " + shlex.join(sys.argv[1:] if invoked else ["launch", args.action])
    script_name = args.render_script.name if args.render_script else "launch.sh"
    plan = ShellBackend(produced_by=produced_by, script_name=script_name).describe(spec)
    if args.render_script:
        write_atomic(args.render_script, plan.text, force=args.force, mode=0o755)
        print(
            f"wrote {args.render_script} (launch {spec.launch_id}); run: bash "
            f"{args.render_script}; stop: bash {args.render_script} stop",
            file=sys.stderr,
        )
        return 0
    print(
        f"# launch {spec.launch_id}: hosts in node-rank order {','.join(spec.hosts)}; "
        f"master {spec.master_addr}:{spec.master_port}",
        file=sys.stderr,
    )
    print(plan.command)
    return 0
