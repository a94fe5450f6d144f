"""Where ``hpc-ddp launch`` keeps its pid files: a private per-user dir, links never followed.

Real launches through real pdsh and clush (their ``exec`` workers: node0/node1 run on this
machine, as in the other launch tests; no second physical host exists here). The machine runs
as root, so "another user's directory" is one chowned to ``nobody``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launch_support import Launch, hpc_ddp, launch_args

TOOLS = ("pdsh", "clush")
NOBODY = 65534


@pytest.mark.parametrize("tool", TOOLS)
def test_a_link_at_the_pid_file_is_not_followed(
    tool: str, tmp_path: Path, launches: list[Launch]
) -> None:
    """Links planted where each host writes its pid file: the files they point to keep their
    bytes and mtime; the launch runs and cleans up its own entries."""
    launch = launch_args(tool, tmp_path)
    launches.append(launch)
    launch_dir = launch.state_dir / launch.launch_id
    launch_dir.mkdir(parents=True, mode=0o700)
    launch.state_dir.chmod(0o700)
    victims = {}
    for host in ("node0", "node1"):
        victim = tmp_path / f"victim-{host}"
        victim.write_text(f"{host}'s file, not the launch's\n")
        (launch_dir / f"{host}.pgid").symlink_to(victim)
        victims[victim] = (victim.read_bytes(), victim.stat().st_mtime_ns)
    res = hpc_ddp([*launch.base, "--", "true"])
    assert res.returncode == 0, res.stderr
    for victim, (data, mtime) in victims.items():
        assert (victim.read_bytes(), victim.stat().st_mtime_ns) == (data, mtime), victim
    assert not launch_dir.exists()  # its pid files (which replaced the links) and dir removed


@pytest.mark.parametrize("tool", TOOLS)
def test_a_state_dir_of_another_user_is_refused(
    tool: str, tmp_path: Path, launches: list[Launch]
) -> None:
    """--state-dir owned by someone else: every host refuses before starting anything (exit
    94), naming the dir and the fix; nothing is written into it."""
    launch = launch_args(tool, tmp_path)
    launches.append(launch)
    launch.state_dir.mkdir(mode=0o755)
    os.chown(launch.state_dir, NOBODY, NOBODY)
    ran = tmp_path / "ran"
    res = hpc_ddp([*launch.base, "--", "touch", str(ran)])
    assert res.returncode == 94, res.stderr
    assert f"{launch.state_dir} is owned by uid 65534, not by you" in res.stderr
    assert "HINT:" in res.stderr and "--state-dir DIR" in res.stderr
    assert not ran.exists()
    assert list(launch.state_dir.iterdir()) == []


def test_the_default_state_dir_is_private_per_user(tmp_path: Path, launches: list[Launch]) -> None:
    """Without --state-dir each host uses $XDG_RUNTIME_DIR/hpc-ddp/launch (0700 at every level),
    not a predictable name in /tmp: the job sees its own pid file appear there."""
    launch = launch_args("pdsh", tmp_path)
    launches.append(launch)
    cut = launch.base.index("--state-dir")
    base = launch.base[:cut] + launch.base[cut + 2 :]
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    runtime.chmod(0o700)
    wait_for_own_pid_file = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "launch_id, host = os.environ['HPC_DDP_LAUNCH_TAG'].split('/')\n"
        "state = Path(os.environ['XDG_RUNTIME_DIR'], 'hpc-ddp', 'launch')\n"
        "pid_file = state / launch_id / f'{host}.pgid'\n"
        "deadline = time.monotonic() + 30\n"
        "while not pid_file.is_file():\n"
        "    if time.monotonic() > deadline:\n"
        "        sys.exit(f'no pid file at {pid_file}')\n"
        "    time.sleep(0.05)\n"
        "modes = {oct(p.stat().st_mode & 0o777) for p in (state.parent, state, pid_file.parent)}\n"
        "print('pid file', pid_file.read_text().strip(), 'dir modes', sorted(modes))\n"
    )
    # A file, not `python3 -c TEXT`: a command argument is data and may hold no line break.
    worker = tmp_path / "wait_for_own_pid_file.py"
    worker.write_text(wait_for_own_pid_file)
    res = hpc_ddp([*base, "--", "python3", str(worker)], env={"XDG_RUNTIME_DIR": str(runtime)})
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert len(lines) == 2 and all("dir modes ['0o700']" in line for line in lines), lines
    assert "--state-dir" not in res.stderr  # the stop hint: each host finds its own default
    assert not (runtime / "hpc-ddp" / "launch" / launch.launch_id).exists()
