"""``hpc-ddp launch``: host order, validation, command building, failure-line parsing (no jobs)."""

from __future__ import annotations

import shlex
import sys

import pytest
from ClusterShell.NodeSet import NodeSet
from launch_support import hpc_ddp

from hpc_ddp.cluster.master_port import derive_port
from hpc_ddp.deploy.shell.host_order import canonical_hosts
from hpc_ddp.deploy.shell.host_scripts import host_script, payload_argv
from hpc_ddp.deploy.shell.runner import parse_failure
from hpc_ddp.deploy.shell.script import render_launch_script
from hpc_ddp.deploy.shell.spec import forwarded_env, make_spec
from hpc_ddp.deploy.shell.tool_argv import launch_command
from hpc_ddp.errors import ConfigError


@pytest.mark.parametrize(
    "text",
    [
        "node[1-2],node10,node9",
        "node[01-03],node10",
        "b1,a2,a10,login",
        "gpu[1-2]-ib,cpu[3,1]",
        "n2,n1,n2,n1",
    ],
)
def test_canonical_order_is_clush_order(text: str) -> None:
    """clush numbers hosts in NodeSet order; our canonical order must be exactly that."""
    assert canonical_hosts(text) == list(NodeSet(text))


def test_canonical_order_dedupes_what_pdsh_would_not() -> None:
    assert canonical_hosts("node1,node0,node1") == ["node0", "node1"]


@pytest.mark.parametrize("text", ["", "node[1-", "a;b", "$(x)"])
def test_bad_host_lists_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        canonical_hosts(text)
    assert err.value.hint


def _spec(**kw):
    base = dict(tool="pdsh", hosts="node[0-1]", command=["hpc-ddp", "env"], launch_id="L1")
    return make_spec(**{**base, **kw})


def test_defaults_master_addr_and_port() -> None:
    ssh = _spec(rcmd="ssh", hosts="b[1-2],a7")
    assert ssh.hosts == ("a7", "b1", "b2")
    assert ssh.master_addr == "a7"  # node rank 0 = first host of the canonical order
    assert ssh.master_port == derive_port("L1")  # the cluster layer's rule, not a copy
    assert _spec(rcmd="exec").master_addr == "127.0.0.1"
    assert _spec(rcmd="exec", master_addr="10.0.0.1", master_port=1234).master_port == 1234


def test_trainer_arguments_become_the_trainer_command() -> None:
    spec = _spec(command=["--epochs", "1"], python="/opt/py")
    assert spec.command == ("/opt/py", "-m", "hpc_ddp.train", "--epochs", "1")
    assert _spec(command=["python3", "w.py"]).command == ("python3", "w.py")
    # No --python: the interpreter running hpc-ddp (its venv), found on every host through the
    # shared file system, for the trainer and for torchrun alike.
    default = _spec(command=["--epochs", "1"])
    assert default.command[:3] == (sys.executable, "-m", "hpc_ddp.train")
    assert default.python == sys.executable
    split = _spec(command=["--epochs", "1"], gpus_per_node=8, gpus_per_process=4)
    assert split.nproc_per_node == 2 and split.world_size == 4
    assert "export HPC_DDP_GPUS_PER_PROCESS=4\n" in host_script(split)  # detect_env reads it


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"gpus_per_node": 8, "gpus_per_process": 3}, "not a multiple"),
        ({"gpus_per_node": 0}, "counts process slots"),
        ({"mode": "mpirun"}, "mode"),
        ({"tool": "srun"}, "tool"),
        ({"rcmd": "rsh"}, "rcmd"),
        ({"command": []}, "no command"),
        ({"launch_id": "a b"}, "--launch-id"),
        ({"env": {"A-B": "1"}}, "variable name"),
        ({"master_port": 70000}, "TCP port"),
    ],
)
def test_invalid_specs_fail_with_hint(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _spec(**kw)
    assert needle in str(err.value) and err.value.hint


def test_torchrun_payload_is_static_rendezvous_with_bounded_waits() -> None:
    spec = _spec(mode="torchrun", gpus_per_node=8, gpus_per_process=2, rcmd="exec")
    argv = payload_argv(spec)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]  # the default python
    for flag in ("--nnodes=2", "--nproc-per-node=4", "--master-addr=127.0.0.1", "--max-restarts=0"):
        assert flag in argv
    assert any(a.startswith("--rdzv-conf=timeout=") for a in argv)
    assert argv[-3:] == ["--no-python", "hpc-ddp", "env"]


def test_percent_is_escaped_except_the_two_placeholders() -> None:
    script = host_script(_spec(env={"FMT": "%d %n 100%"}))
    assert "host=%h\n" in script and "node_rank=%n\n" in script
    assert "export FMT='%%d %%n 100%%'" in script


def test_tool_argv_layers() -> None:
    """Each shell layer is quoted once: exec gets an argv, ssh/clush get one shell string."""
    pdsh_exec = launch_command(_spec(rcmd="exec")).argv
    assert pdsh_exec[:8] == ("pdsh", "-S", "-R", "exec", "-f", "32", "-w", "node0,node1")
    assert pdsh_exec[8:10] == ("bash", "-c")
    pdsh_ssh = launch_command(_spec(rcmd="ssh"))
    assert shlex.split(pdsh_ssh.argv[-1])[:2] == ["bash", "-c"]
    assert dict(pdsh_ssh.env)["PDSH_SSH_ARGS_APPEND"].startswith("-oBatchMode=yes")
    clush_ssh = launch_command(_spec(tool="clush", rcmd="ssh")).argv
    assert clush_ssh[:3] == ("clush", "-R", "exec") and "--maxrc" in clush_ssh
    outer = shlex.split(clush_ssh[-1])
    assert outer[0] == "ssh" and outer[outer.index("%h") + 1].startswith("bash -c ")


def test_fanout_is_never_below_the_host_count() -> None:
    argv = launch_command(_spec(hosts="n[1-100]")).argv
    assert argv[argv.index("-f") + 1] == "100"


def test_forwarded_env_picks_what_a_remote_shell_lacks() -> None:
    env = forwarded_env(
        {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "CUDA_VISIBLE_DEVICES": "0", "HOME": "/r"}
    )
    assert env == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x"}


def test_the_api_forwards_what_the_cli_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_spec (hpc_ddp.make_launch_spec) forwards this process's NCCL_*, PYTHONPATH... as
    `hpc-ddp launch` does; --env (env=) wins, --no-forward-env (forward_env=False) drops them.
    The CLI's script exports exactly the API spec's variables."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("PYTHONPATH", "/site")
    common = {"tool": "pdsh", "hosts": "n[1-2]", "command": ["true"], "launch_id": "a-1"}
    assert make_spec(**common).env == {
        "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/site",
    }
    assert make_spec(**common, env={"NCCL_DEBUG": "WARN"}).env["NCCL_DEBUG"] == "WARN"
    assert make_spec(**common, forward_env=False).env == {"OMP_NUM_THREADS": "1"}
    cli = hpc_ddp(
        ["launch", "pdsh", "--hosts", "n[1-2]", "--launch-id", "a-1", "--dry-run", "--", "true"]
    )
    assert cli.returncode == 0, cli
    assert "NCCL_DEBUG=INFO" in cli.stdout and "PYTHONPATH=/site" in cli.stdout, cli.stdout


@pytest.mark.parametrize(
    ("line", "hosts", "code"),
    [
        ("pdsh@vm: node1: bash exited with exit code 3", ("node1",), 3),
        ("pdsh@vm: node1: bash killed by signal 9", ("node1",), 137),
        ("pdsh@vm: node1: ssh exited with exit code 255", ("node1",), 255),
        ("pdsh@vm: node0: command timeout", ("node0",), 124),
        ("clush: node1: exited with exit code 137", ("node1",), 137),
        ("clush: node[0-1]: command timeout", ("node0", "node1"), 124),
        ("node1: hpc-ddp-launch: host=node1 node_rank=1 exit=1", ("node1",), 1),
    ],
)
def test_failure_lines_are_recognised(line: str, hosts: tuple[str, ...], code: int) -> None:
    failure = parse_failure(line)
    assert failure is not None and failure.hosts == hosts and failure.code == code


@pytest.mark.parametrize(
    "line",
    ["node0: hpc-ddp-launch: host=node0 node_rank=0 exit=0", "node0: exited with exit code 1"],
)
def test_other_lines_are_not_failures(line: str) -> None:
    assert parse_failure(line) is None


def test_dry_run_prints_the_exact_command() -> None:
    res = hpc_ddp(
        ["launch", "clush", "--rcmd", "exec", "--hosts", "n[1-2]", "--launch-id", "L2",
         "--master-port", "23001", "--dry-run", "--", "python3", "w.py", "--a b"],
        timeout=30,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    spec = make_spec(
        tool="clush", hosts="n[1-2]", command=["python3", "w.py", "--a b"], rcmd="exec",
        launch_id="L2", master_port=23001, workdir=None,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert shlex.split(res.stdout)[:-1] == list(launch_command(spec).argv)[:-1]
    assert "'--a b'" in res.stdout  # the command's own argv survived, quoted once


def test_bad_env_flag_is_a_clear_error() -> None:
    res = hpc_ddp(["launch", "pdsh", "--hosts", "n1", "--env", "NOEQUALS", "--", "true"])
    assert res.returncode == 2
    assert "--env 'NOEQUALS' is not K=V" in res.stderr and "HINT:" in res.stderr


def test_stop_needs_a_launch_id() -> None:
    res = hpc_ddp(["launch", "stop", "--hosts", "n1"])
    assert res.returncode == 2 and "--launch-id" in res.stderr


def test_rendered_script_names_its_order_and_stop() -> None:
    text = render_launch_script(_spec(tool="clush", rcmd="ssh"))
    assert text.startswith("#!/usr/bin/env bash")
    assert "SORTED" in text and 'if [ "${1:-}" = stop ]' in text
    from hpc_ddp import __version__

    assert f"Rendered by `hpc-ddp launch` (hpc-ddp {__version__})" in text.splitlines()[1]


def test_launch_modules_never_import_torch() -> None:
    """deploy/ must stay torch-free: a dry run or a stop answers at once."""
    import subprocess
    import sys

    code = (
        "import sys, hpc_ddp.commands.launch, hpc_ddp.deploy.shell.runner, "
        "hpc_ddp.deploy.shell.script, hpc_ddp.deploy.shell.node_agent; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_tool_is_a_clear_error() -> None:
    res = hpc_ddp(["launch", "pdsh", "--hosts", "n1", "--tool-path", "/nonexistent/pdsh", "--",
                   "true"])  # fmt: skip
    assert res.returncode == 2
    assert "'/nonexistent/pdsh' is not installed" in res.stderr and "HINT:" in res.stderr


# --- data never becomes code (the full table is tests/test_hostile_scripts.py) -------------
@pytest.mark.parametrize("addr", ["node01", "10.0.0.1", "fd00::1", "::ffff:10.0.0.1", "n-1.ib"])
def test_master_addr_takes_host_names_and_addresses(addr: str) -> None:
    spec = _spec(master_addr=addr)
    assert f"--master-addr={addr}" in payload_argv(spec)
    assert f"master {addr}:" in render_launch_script(spec)


@pytest.mark.parametrize(
    "addr", ["node1\n", "a\nrm -rf ~", "$(id)", "-oProxyCommand=x", "fd00::1%eth0", "a b", ""]
)
def test_master_addr_is_validated(addr: str) -> None:
    with pytest.raises(ConfigError) as err:
        _spec(master_addr=addr)
    assert f"--master-addr {addr!r}" in str(err.value) and err.value.hint


@pytest.mark.parametrize("text", ["node1\n", "node[1-2]\n", "node1,-oProxyCommand=x", "node1\r"])
def test_host_lists_refuse_trailing_newlines_and_options(text: str) -> None:
    with pytest.raises(ConfigError, match="--hosts"):
        canonical_hosts(text)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"command": ["python3", "w.py", "a\nb"]}, "command argument 2 'a\\nb'"),
        ({"env": {"NCCL_DEBUG": "INFO\n"}}, "env NCCL_DEBUG 'INFO\\n'"),
        ({"workdir": "/w\u2028x"}, "--workdir '/w\\u2028x': U+2028 LINE SEPARATOR"),
        ({"setup": ("source a\nb",)}, "--setup[0]"),
        ({"launch_id": "L1\n"}, "--launch-id 'L1\\n'"),
    ],
)
def test_launch_values_refuse_control_characters(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _spec(**kw)
    assert needle in str(err.value) and err.value.hint


def test_rendered_script_keeps_its_comments_whatever_the_file_name(tmp_path) -> None:
    script = tmp_path / "x\nrm -rf ~ #.sh"
    res = hpc_ddp(["launch", "pdsh", "--hosts", "n1", "--launch-id", "L3", "--render-script",
                   str(script), "--", "true"], timeout=30)  # fmt: skip
    assert res.returncode == 0, res.stderr
    head = script.read_text().split("\nset -u\n")[0].splitlines()
    assert all(line.startswith("#") for line in head), head
    assert any("x\\nrm -rf ~ #.sh" in line for line in head)


def test_render_script_never_overwrites_without_force(tmp_path) -> None:
    script = tmp_path / "launch.sh"
    script.write_text("mine\n")
    args = ["launch", "pdsh", "--hosts", "n1", "--launch-id", "L4", "--render-script", str(script)]
    res = hpc_ddp([*args, "--", "true"], timeout=30)
    assert res.returncode == 2 and "exists" in res.stderr and "--force" in res.stderr
    assert script.read_text() == "mine\n"
    assert hpc_ddp([*args, "--force", "--", "true"], timeout=30).returncode == 0
    assert script.read_text().startswith("#!/usr/bin/env bash")
