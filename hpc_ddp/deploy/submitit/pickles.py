"""submitit's pickles, read only where nobody but this user could have written them.

submitit keeps a job's call (``<id>_submitted.pkl``) and every task's outcome
(``<id>_<task>_result.pkl``) as pickles in its folder, and loading a pickle runs whatever code
its writer chose. The folder comes from ``--folder``, from Slurm's record of any user's job (its
log's directory) or from a run dir's lock owner file, so a planted pickle would run as whoever
asks about the job, root included. A pickle is therefore loaded only when its folder is a private
directory of this user (``private_paths.private_dir_problem``: owned by this user, a real
directory, not writable by group or others) and the file itself is a regular file of this user's
that nobody else can write (``private_paths.read_private_file``: never a link, a FIFO or a device,
its size bounded). Anything else is refused with the reason, for the caller to report.
Pure Python; never imports submitit (the pickle does, when it needs it).
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path
from typing import Any

from hpc_ddp.private_paths import NotPrivateFileError, private_dir_problem, read_private_file
from hpc_ddp.regular_file import FileTooLargeError, NotRegularFileError

# A task's result is its return value; the toolkit's own tasks return a small dict, and a
# submitted call holds the function and its arguments. The bound only stops a planted file
# from making a reader load without end.
PICKLE_LIMIT = 256 << 20
# Said with every refusal: why a file that is there was not read.
WHY = "a pickle runs code when it is loaded, so hpc-ddp loads only pickles nobody else could write"


class PickleRefusedError(OSError):
    """A pickle that was not loaded because someone else could have written it."""


def folder_problem(folder: Path) -> str | None:
    """Why pickles in ``folder`` are not loaded, or None if they may be (the folder is a
    private directory of this user's)."""
    try:
        problem = private_dir_problem(folder)
    except OSError as err:
        return f"its folder {folder} cannot be checked ({err.strerror})"
    return f"its folder {folder} is {problem}" if problem else None


def load(path: Path) -> Any:
    """Unpickle ``path`` once its folder and the file itself are this user's alone (see the
    module's docstring). ``FileNotFoundError`` if it is not there; ``PickleRefusedError`` naming
    the reason if someone else could have written it (its content never read)."""
    path = Path(path)
    if problem := folder_problem(path.parent):
        if not os.path.lexists(path):
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        raise PickleRefusedError(errno.EPERM, problem, str(path))
    try:
        data = read_private_file(path, PICKLE_LIMIT)
    except FileNotFoundError:
        raise
    except (NotPrivateFileError, NotRegularFileError, FileTooLargeError) as err:
        raise PickleRefusedError(errno.EPERM, f"it is {err.strerror}", str(path)) from None
    except OSError as err:
        why = f"it cannot be read ({err.strerror})"
        raise PickleRefusedError(errno.EPERM, why, str(path)) from None
    return pickle.loads(data)


def refusal_note(err: OSError) -> str:
    """One line for a report: which pickle was not read, and why."""
    return f"{err.filename} not read: {err.strerror}; {WHY}"
