"""Where the toolkit keeps per-user state, and how it writes a file without following a link.

A fixed name in a shared directory (``/tmp/hpc-ddp-launch-$USER``) is predictable: another user
can create it first and own it, or plant a symbolic link where the toolkit will write, so that
the write lands in a file of the attacker's choosing. So:

- :func:`state_dir` is a private per-user directory: ``$XDG_RUNTIME_DIR/hpc-ddp`` when
  ``XDG_RUNTIME_DIR`` is usable (a directory of this user that nobody else can write, as the
  login manager provides), else ``$XDG_STATE_HOME/hpc-ddp`` (default ``~/.local/state/hpc-ddp``).
  State that must outlive the login session (XDG_RUNTIME_DIR is emptied at logout) goes under
  :func:`lasting_state_base`, the second of the two.
- :func:`ensure_private_dir` creates a directory with mode 0700, and accepts an existing one only
  if it is a real directory (not a link), this user owns it and neither group nor others can
  write it; anything else is refused with an error naming the directory and the fix.
- :func:`read_private_file` reads a file only if this user owns it and nobody else can write it
  (a pickle, which runs code when it is loaded, is read only so).
- :func:`create_file` creates a file that must not exist yet (``O_EXCL | O_NOFOLLOW``: not even
  a dangling link); :func:`replace_file` writes a whole file through such a new temporary file
  and a rename, which replaces a link at the final name instead of writing through it.

Hosts of a scheduler-less launch only promise bash and coreutils, so the same rules exist in bash
(:data:`SHELL_FUNCTIONS`), for the launch's host script; tests/test_private_paths.py checks that
both resolve the same directory.
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp import regular_file
from hpc_ddp.errors import HpcDdpError

APP_DIR = "hpc-ddp"
SHARED_WRITE = 0o022  # group- or world-writable: someone else could swap entries inside


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def owner_problem(st: os.stat_result) -> str | None:
    """Why what ``st`` describes could hold another user's content (owned by someone else, or
    writable by group or others), or None if only this user can have written it."""
    if st.st_uid != os.geteuid():
        return f"owned by {_user(st.st_uid)}, not by you ({_user(os.geteuid())})"
    if st.st_mode & SHARED_WRITE:
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def private_dir_problem(path: Path) -> str | None:
    """Why ``path`` (which exists) is not a private directory of this user, or None if it is."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return owner_problem(st)


class NotPrivateFileError(OSError):
    """A file that another user owns or could write: what it holds may not be theirs to say."""


def read_private_file(path: Path, limit: int) -> bytes:
    """The content of ``path``, a regular file of this user's that nobody else can write, at
    most ``limit`` bytes: opened as ``regular_file.open_regular`` does (never a link, a FIFO or a
    device, so the open cannot block), its owner and mode checked on the open descriptor (no race
    with a swap), then read bounded. ``NotPrivateFileError`` (an ``OSError``) otherwise."""
    with regular_file.open_regular(path) as f:
        if problem := owner_problem(os.fstat(f.fileno())):
            raise NotPrivateFileError(errno.EPERM, problem, str(path))
        return regular_file.read_whole(f, limit, path)


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700 (missing parents with the usual mode), or check that the
    existing one is private (see :func:`private_dir_problem`); returns ``path``."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = private_dir_problem(path)
    except OSError as err:
        raise HpcDdpError(
            f"cannot create the private directory {path}: {err.strerror}",
            hint="make its parent writable by you, or point XDG_STATE_HOME (or the command's "
            "directory option) at a directory of yours",
        ) from None
    if problem:
        raise HpcDdpError(
            f"{path} is {problem}; hpc-ddp keeps private state there and refuses a directory "
            "that another user could change",
            hint=f"if it is yours, `chmod 700 {path}`; otherwise remove it (as its owner or "
            "root) or point XDG_RUNTIME_DIR / XDG_STATE_HOME (or the command's directory "
            "option) at a directory only you can write",
        )
    return path


def _usable_runtime_dir(path: str) -> bool:
    """XDG_RUNTIME_DIR as the XDG spec promises it: absolute, this user's, nobody else's."""
    if not os.path.isabs(path):
        return False
    try:
        return private_dir_problem(Path(path)) is None and os.access(path, os.W_OK | os.X_OK)
    except OSError:
        return False


def state_base(environ: Mapping[str, str] | None = None) -> Path:
    """The toolkit's per-user state directory (not created): see the module docstring."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and _usable_runtime_dir(runtime):
        return Path(runtime) / APP_DIR
    return lasting_state_base(env)


def lasting_state_base(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/hpc-ddp`` (default ``~/.local/state/hpc-ddp``), not created: for
    state that outlives the login session."""
    env = os.environ if environ is None else environ
    state_home = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state_home):  # the XDG spec: a relative value is invalid, ignore it
        home = env.get("HOME") or str(Path.home())
        state_home = os.path.join(home, ".local", "state")
    return Path(state_home) / APP_DIR


def state_dir(*parts: str, environ: Mapping[str, str] | None = None) -> Path:
    """The private directory ``<state_base>/<parts...>``, each level created 0700 or checked."""
    path = ensure_private_dir(state_base(environ))
    for part in parts:
        path = ensure_private_dir(path / part)
    return path


def create_file(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Create ``path`` holding ``data``; FileExistsError if anything is there, even a link.

    ``mode`` is filtered by the umask, as for ``open()``.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def replace_file(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write ``path`` whole and atomically, never through a link at ``path``.

    The bytes go to a new file with a random name beside it (created as :func:`create_file`
    does), which is then renamed over ``path``: a rename replaces whatever entry is there (a
    link included) and never writes into the file a link points to.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    create_file(tmp, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# The same rules in bash. ``hpc_ddp_state_base`` prints state_base(); ``hpc_ddp_private_dir DIR``
# creates DIR 0700 or checks it, and on failure says why on stderr and returns 1.
SHELL_FUNCTIONS = r"""
hpc_ddp_not_private() {
  if [ -L "$1" ]; then echo "a symbolic link"
  elif [ ! -e "$1" ]; then echo "missing (it could not be created)"
  elif [ ! -d "$1" ]; then echo "not a directory"
  elif [ ! -O "$1" ]; then echo "owned by uid $(stat -c %u -- "$1"), not by you (uid $(id -u))"
  elif (( 8#$(stat -c %a -- "$1") & 8#022 )); then
    echo "writable by other users (mode $(stat -c %a -- "$1"))"
  else return 1
  fi
}
hpc_ddp_state_base() {
  local runtime=${XDG_RUNTIME_DIR:-} state=${XDG_STATE_HOME:-}
  if [ "${runtime:0:1}" = / ] && ! hpc_ddp_not_private "$runtime" >/dev/null \
      && [ -w "$runtime" ] && [ -x "$runtime" ]; then
    echo "$runtime/hpc-ddp"; return
  fi
  [ "${state:0:1}" = / ] || state=$HOME/.local/state
  echo "$state/hpc-ddp"
}
hpc_ddp_private_dir() {
  local why
  mkdir -p -m 0700 -- "$1" 2>/dev/null
  if why=$(hpc_ddp_not_private "$1"); then
    echo "hpc-ddp: $1 is $why; hpc-ddp keeps private state there and refuses a directory that" \
      "another user could change" >&2
    echo "HINT: if it is yours, chmod 700 $1; otherwise remove it (as its owner or root) or" \
      "choose a directory only you can write" >&2
    return 1
  fi
}
"""
