"""hpc_ddp.private_paths on real directories, real ownership (chown to nobody) and real links.

The machine runs as root, so "another user's directory" is one chowned to ``nobody``. The bash
twin of the rules (for the launch's host script) runs in a real bash and must agree with Python.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.private_paths import (
    SHELL_FUNCTIONS,
    create_file,
    ensure_private_dir,
    replace_file,
    state_base,
    state_dir,
)

NOBODY = 65534


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700)
    path.chmod(0o700)  # whatever the umask
    return path


def test_a_new_state_dir_is_created_0700(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}
    path = state_dir("launch", environ=env)
    assert path == tmp_path / "state" / "hpc-ddp" / "launch"
    for level in (path, path.parent):
        assert level.stat().st_mode & 0o777 == 0o700


def test_a_state_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """Another user made ~/.local/state/hpc-ddp first: refused, naming the dir and the fix,
    and nothing is created inside it."""
    planted = _private(tmp_path / "hpc-ddp")
    os.chown(planted, NOBODY, NOBODY)
    env = {"XDG_STATE_HOME": str(tmp_path)}
    with pytest.raises(HpcDdpError) as err:
        state_dir("launch", environ=env)
    text = str(err.value)
    assert str(planted) in text and "owned by" in text and "uid 65534" in text
    assert "HINT:" in text and "XDG_STATE_HOME" in text
    assert list(planted.iterdir()) == []


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777])
def test_a_dir_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    shared = _private(tmp_path / "shared")
    shared.chmod(mode)
    with pytest.raises(HpcDdpError, match=f"writable by other users \\(mode {mode:04o}\\)"):
        ensure_private_dir(shared)


def test_a_link_in_place_of_the_dir_is_refused(tmp_path: Path) -> None:
    target = _private(tmp_path / "elsewhere")
    (tmp_path / "hpc-ddp").symlink_to(target)
    with pytest.raises(HpcDdpError, match="a symbolic link"):
        state_dir(environ={"XDG_STATE_HOME": str(tmp_path)})
    assert list(target.iterdir()) == []


def test_a_readable_dir_of_ours_is_accepted(tmp_path: Path) -> None:
    mine = _private(tmp_path / "mine")
    mine.chmod(0o755)  # others may read, not write: the toolkit's files stay its own
    assert ensure_private_dir(mine) == mine


def _bash_state_base(env: dict[str, str]) -> str:
    script = SHELL_FUNCTIONS + "\nhpc_ddp_state_base\n"
    done = subprocess.run(
        ["bash", "-c", script], env={"PATH": os.environ["PATH"], **env},
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_python_and_bash_pick_the_same_dir(tmp_path: Path) -> None:
    """The host script's bash and the Python module follow one rule: XDG_RUNTIME_DIR when it is
    usable, else XDG_STATE_HOME (absolute only), else ~/.local/state."""
    runtime = _private(tmp_path / "runtime")
    others = _private(tmp_path / "others")
    os.chown(others, NOBODY, NOBODY)
    open_to_all = _private(tmp_path / "open")
    open_to_all.chmod(0o777)
    home, state = str(tmp_path / "home"), str(tmp_path / "state")
    cases = {
        "usable runtime dir": ({"XDG_RUNTIME_DIR": str(runtime)}, runtime / "hpc-ddp"),
        "another user's runtime dir": ({"XDG_RUNTIME_DIR": str(others)}, None),
        "runtime dir others can write": ({"XDG_RUNTIME_DIR": str(open_to_all)}, None),
        "missing runtime dir": ({"XDG_RUNTIME_DIR": str(tmp_path / "gone")}, None),
        "relative runtime dir": ({"XDG_RUNTIME_DIR": "runtime"}, None),
        "no runtime dir": ({}, None),
    }
    for name, (extra, expected) in cases.items():
        for state_home, fallback in (({"XDG_STATE_HOME": state}, state), ({}, None)):
            env = {"HOME": home, **extra, **state_home}
            want = expected or Path(fallback or f"{home}/.local/state") / "hpc-ddp"
            assert state_base(env) == want, name
            assert _bash_state_base(env) == str(want), name
    # A relative XDG_STATE_HOME is invalid (XDG spec): both ignore it.
    env = {"HOME": home, "XDG_STATE_HOME": "rel"}
    assert str(state_base(env)) == _bash_state_base(env) == f"{home}/.local/state/hpc-ddp"


def test_bash_refuses_what_python_refuses(tmp_path: Path) -> None:
    others = _private(tmp_path / "others")
    os.chown(others, NOBODY, NOBODY)
    script = SHELL_FUNCTIONS + f"\nhpc_ddp_private_dir {others} && echo accepted\n"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "accepted" not in done.stdout
    assert f"{others} is owned by uid 65534" in done.stderr and "HINT:" in done.stderr
    fresh = tmp_path / "fresh" / "dir"
    script = SHELL_FUNCTIONS + f"\nhpc_ddp_private_dir {fresh} && echo accepted\n"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "accepted" and fresh.stat().st_mode & 0o777 == 0o700


def test_replace_file_never_writes_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    link = tmp_path / "dir" / "progress.json"
    link.parent.mkdir()
    link.symlink_to(victim)
    replace_file(link, b"{}\n")
    assert victim.read_bytes() == b"precious\n"
    assert not link.is_symlink() and link.read_bytes() == b"{}\n"
    assert sorted(p.name for p in link.parent.iterdir()) == ["progress.json"]  # no temp left


def test_create_file_refuses_even_a_dangling_link(tmp_path: Path) -> None:
    target = tmp_path / "would-be-created"
    (tmp_path / "marker").symlink_to(target)
    with pytest.raises(FileExistsError):
        create_file(tmp_path / "marker", b"x")
    assert not target.exists()
