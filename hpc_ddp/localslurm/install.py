"""Where a cluster's Slurm lives: the system's packages, or Debian packages unpacked under a root.

An unpacked root is what ``dpkg -x`` of Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and
``slurm-wlm-basic-plugins`` (and ``munge``, ``libmunge2``) leaves in a directory: ROOT/usr/sbin,
ROOT/usr/bin, ROOT/usr/lib/<triplet>/slurm-wlm (plugins and libslurmfull.so) and
ROOT/usr/lib/<triplet>. It serves machines where Slurm cannot be installed (no network, no
package manager, an image that is not Debian). Slurm's compiled-in /usr paths are redirected:
the plugins by ``PluginDir`` in slurm.conf, slurmstepd by ``slurmd -d``, the programs and the
libraries they link (libslurmfull.so's RUNPATH points at /usr) by PATH and LD_LIBRARY_PATH.
Debian ships the daemons as ``slurmd-wlm`` etc. and makes the ``slurmd`` names with
update-alternatives at install time, which ``dpkg -x`` does not run; see ``daemon_paths``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.errors import ConfigError

# Paths go into slurm.conf and onto command lines: plain absolute paths only (no spaces, no
# newlines that would start another slurm.conf line, no shell characters).
SAFE_PATH = re.compile(r"/[A-Za-z0-9._+/-]*")
# The programs the toolkit runs. ldd checks these in an unpacked root before anything starts.
DAEMONS = ("slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("scontrol", "sinfo", "squeue", "scancel", "sbatch", "srun")
MUNGE = ("munged",)  # the cluster's own munged (munge.py) comes from the root too
# Where the system's daemons are looked for (a root install puts its own dirs first).
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_LDD_MISSING = re.compile(r"^\s*(\S+) => not found", re.M)


def checked_path(value: str | Path, what: str) -> str:
    """``value`` as a plain absolute path, or a ConfigError naming ``what`` was wrong."""
    text = str(value)
    if not SAFE_PATH.fullmatch(text) or "/../" in f"{text}/":
        raise ConfigError(
            f"{what} {text!r} is not a plain absolute path",
            hint="use an absolute path of letters, digits and . _ + - / only (no '..')",
        )
    return text


@dataclass(frozen=True)
class SlurmInstall:
    """The system's Slurm (``root`` empty) or Debian packages unpacked under ``root``."""

    root: str = ""

    def __post_init__(self) -> None:
        if self.root:
            checked_path(self.root, "the Slurm root")

    @property
    def unpacked(self) -> bool:
        return bool(self.root)

    # --- where things are -------------------------------------------------------------
    def bin_dirs(self) -> list[str]:
        return [f"{self.root}/usr/sbin", f"{self.root}/usr/bin"] if self.root else []

    def plugin_dir(self) -> str | None:
        """ROOT/usr/lib/<triplet>/slurm-wlm (Debian's layout); None for the system's Slurm."""
        if not self.root:
            return None
        found = sorted(Path(self.root).glob("usr/lib/*/slurm-wlm"))
        return str(found[0]) if found else None

    def lib_dirs(self) -> list[str]:
        """The unpacked library dirs that exist, Slurm's own first."""
        plugins = self.plugin_dir()
        if plugins is None:
            return []
        triplet = Path(plugins).parent.name
        dirs = [plugins, f"{self.root}/usr/lib/{triplet}", f"{self.root}/lib/{triplet}"]
        return [d for d in dirs if Path(d).is_dir()]

    def which(self, program: str) -> str | None:
        """The program's path: under the root (``NAME`` or Debian's ``NAME-wlm``), else PATH."""
        if not self.root:
            return shutil.which(program, path=os.environ.get("PATH") or SYSTEM_PATH)
        for folder in ("sbin", "bin"):
            for name in (program, f"{program}-wlm"):
                path = Path(self.root, "usr", folder, name)
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
        return None

    def daemon_paths(self, link_dir: Path) -> dict[str, str]:
        """How to start each daemon: its bare name (found on PATH), or for an unpacked root a
        symlink in ``link_dir`` that carries the daemon's own name.

        Slurm 22.05 tells which daemon it is from argv[0]'s basename: run as ``slurmd-wlm``,
        slurmd does not count its node's GRES. slurmd starts slurmstepd by the path given with
        ``-d`` as argv[0], so slurmstepd gets a link too (its compiled-in path is /usr/sbin).
        """
        if not self.root:
            return {name: name for name in DAEMONS}
        link_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name in DAEMONS:
            link = link_dir / name
            link.unlink(missing_ok=True)
            link.symlink_to(str(self.which(name)))
            paths[name] = str(link)
        return paths

    def search_path(self, path: str) -> str:
        return os.pathsep.join([*self.bin_dirs(), path or SYSTEM_PATH])

    # --- environments -------------------------------------------------------------------
    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables a Slurm program of this install needs on top of ``base``: nothing for
        the system's Slurm; PATH and LD_LIBRARY_PATH with the root's dirs first otherwise."""
        if not self.root:
            return {}
        environ = os.environ if base is None else base
        return {
            "PATH": self.search_path(environ.get("PATH", "")),
            "LD_LIBRARY_PATH": _joined(self.lib_dirs(), environ.get("LD_LIBRARY_PATH", "")),
        }

    def shell_exports(self) -> list[tuple[str, str]]:
        """(name, prefix) pairs for ``export NAME=prefix"${NAME:+:$NAME}"`` lines."""
        if not self.root:
            return []
        return [
            ("PATH", os.pathsep.join(self.bin_dirs())),
            ("LD_LIBRARY_PATH", os.pathsep.join(self.lib_dirs())),
        ]

    # --- checks -------------------------------------------------------------------------
    def check(self, programs: tuple[str, ...] = DAEMONS + CLIENTS + MUNGE) -> None:
        """For an unpacked root: every program is there, in dirs only root can change, and
        finds every library it links."""
        if not self.root:
            return
        hint = (
            "unpack Debian's slurm packages there: for p in slurmctld slurmd slurm-client "
            f'slurm-wlm-basic-plugins munge libmunge2; do dpkg -x "$p"_*.deb {self.root}; done'
        )
        if not Path(self.root).is_dir():
            raise ConfigError(f"the Slurm root {self.root} does not exist", hint=hint)
        absent = [p for p in programs if self.which(p) is None]
        if absent or self.plugin_dir() is None:
            what = ", ".join(absent) if absent else "usr/lib/<triplet>/slurm-wlm (the plugins)"
            raise ConfigError(f"the Slurm root {self.root} has no {what}", hint=hint)
        self._check_owned(programs)
        missing = self.missing_libraries(programs)
        if missing:
            lines = [f"{prog}: {', '.join(libs)}" for prog, libs in missing.items()]
            raise ConfigError(
                f"Slurm under {self.root} cannot run here: libraries not found:\n  "
                + "\n  ".join(lines),
                hint=f"unpack the packages that hold them into {self.root} as well "
                f"(dpkg -x PKG.deb {self.root}; e.g. libhwloc15 for libhwloc.so.15)",
            )

    def _check_owned(self, programs: tuple[str, ...]) -> None:
        """The daemons run as root from here: a dir or program that another user can write
        would let them plant what root then runs."""
        paths = [Path(self.root), *map(Path, self.bin_dirs()), *map(Path, self.lib_dirs())]
        paths += [Path(str(self.which(p))) for p in programs]
        for path in paths:
            st = path.stat()
            if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
                raise ConfigError(
                    f"{path} (in the Slurm root) is owned by uid {st.st_uid} with mode "
                    f"{st.st_mode & 0o777:o}: another user could change what root runs",
                    hint=f"unpack the packages as root into a dir only root can write "
                    f"(chown -R root: {self.root}; chmod -R go-w {self.root})",
                )

    def missing_libraries(self, programs: tuple[str, ...]) -> dict[str, list[str]]:
        """{program: sonames ldd cannot find} with this install's LD_LIBRARY_PATH."""
        env = {**os.environ, **self.env(), "LC_ALL": "C"}
        missing: dict[str, list[str]] = {}
        for prog in programs:
            proc = subprocess.run(
                ["ldd", str(self.which(prog))], env=env, capture_output=True, text=True, timeout=30
            )
            libs = _LDD_MISSING.findall(proc.stdout)
            if libs:
                missing[prog] = sorted(set(libs))
        return missing


SYSTEM = SlurmInstall()


def _joined(first: list[str], rest: str) -> str:
    return os.pathsep.join([*first, rest] if rest else first)
