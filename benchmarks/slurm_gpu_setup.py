"""The machine side of benchmarks/slurm_gpu.py: facts, Slurm unpacked from .deb files, the cluster.

Kept apart from the job runs so each file has one job. Nothing here trains.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from hpc_ddp.localslurm.install import SlurmInstall

# The packages that make the Slurm root; any other .deb in the folder is a library candidate,
# unpacked only for the sonames this machine lacks (its own libraries are never shadowed).
SLURM_DEBS = (
    "slurmctld",
    "slurmd",
    "slurm-client",
    "slurm-wlm-basic-plugins",
    "munge",
    "libmunge2",
)
_SONAME_MISSING = re.compile(r"^\s*(\S+) => not found", re.M)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    """The finished command, whatever its exit code (127 and the error if it is missing)."""
    kw.setdefault("timeout", 120)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    except FileNotFoundError as err:
        return subprocess.CompletedProcess(cmd, 127, "", str(err))


def machine_facts() -> dict:
    smi = run(["nvidia-smi", "--query-gpu=index,name,memory.total,pci.bus_id", "--format=csv"])
    os_release = Path("/etc/os-release")
    pretty = ""
    if os_release.exists():
        m = re.search(r'^PRETTY_NAME="?([^"\n]*)', os_release.read_text(), re.M)
        pretty = m.group(1) if m else ""
    cgroup_fs = run(["stat", "-f", "-c", "%T", "/sys/fs/cgroup"]).stdout.strip()
    torch_ver = run([sys.executable, "-c", "import torch; print(torch.__version__)"]).stdout
    return {
        "gpus": [ln for ln in smi.stdout.splitlines()[1:] if ln.strip()],
        "os": pretty,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_ver.strip(),
        "cgroup_fs": cgroup_fs,
        "interfaces": sorted(p.name for p in Path("/sys/class/net").iterdir()),
    }


def deb_package(path: Path) -> str:
    return path.name.split("_", 1)[0]


def extract_deb(deb: Path, into: Path) -> None:
    """``dpkg -x``, or where the image has no dpkg the same by hand: a .deb is an ar archive
    whose data.tar.* holds the files."""
    into.mkdir(parents=True, exist_ok=True)
    if shutil.which("dpkg"):
        proc = run(["dpkg", "-x", str(deb), str(into)])
        if proc.returncode:
            raise RuntimeError(f"dpkg -x {deb}: {proc.stderr.strip()}")
        return
    data = deb.read_bytes()
    pos = 8  # "!<arch>\n"
    while pos + 60 <= len(data):
        name = data[pos : pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48 : pos + 58].decode().strip())
        body = pos + 60
        if name.startswith("data.tar"):
            member = into / f".{deb.name}.{name}"
            member.write_bytes(data[body : body + size])
            try:
                with tarfile.open(member) as tar:  # .xz and .gz; Debian 12 uses .xz
                    tar.extractall(into, filter="tar")
            finally:
                member.unlink()
            return
        pos = body + size + (size % 2)
    raise RuntimeError(f"{deb}: no data.tar member")


def unpack_slurm(debs: Path, root: Path) -> dict:
    """Slurm's and munge's packages into ``root``; then, round by round, the library files
    that ldd reports missing, taken from the other .deb files (unpacked aside)."""
    if root.exists():
        shutil.rmtree(root)
    all_debs = sorted(debs.glob("*.deb"))
    mine = [d for d in all_debs if deb_package(d) in SLURM_DEBS]
    absent = sorted(set(SLURM_DEBS) - {deb_package(d) for d in mine})
    if absent:
        raise RuntimeError(f"{debs} lacks the packages {', '.join(absent)}")
    for deb in mine:
        extract_deb(deb, root)
    staging = root.parent / f"{root.name}-libs"
    shutil.rmtree(staging, ignore_errors=True)
    for deb in all_debs:
        if deb not in mine:
            extract_deb(deb, staging)
    install = SlurmInstall(str(root))
    lib_dir = Path(str(install.plugin_dir())).parent  # ROOT/usr/lib/<triplet>
    taken: dict[str, str] = {}
    while True:
        missing = missing_sonames(install)
        new = [s for s in missing if s not in taken]
        found = {s: _find_lib(staging, s) for s in new}
        if not any(found.values()):
            break
        for soname, path in found.items():
            if path is not None:
                shutil.copy2(path, lib_dir / soname)  # follows the symlink to the real file
                taken[soname] = str(path.relative_to(staging))
    return {"root": str(root), "debs": [d.name for d in mine], "libs_from_debs": taken,
            "still_missing": missing}  # fmt: skip


def missing_sonames(install: SlurmInstall) -> dict[str, list[str]]:
    """{soname: [files needing it]} over the programs and every plugin of the root."""
    env = {**os.environ, **install.env(), "LC_ALL": "C"}
    files = [str(install.which(p)) for p in ("slurmctld", "slurmd", "slurmstepd", "srun")]
    files += [str(install.which("munged") or "")]
    files += [str(p) for p in sorted(Path(str(install.plugin_dir())).glob("*.so"))]
    out: dict[str, list[str]] = {}
    for f in filter(None, files):
        for soname in _SONAME_MISSING.findall(run(["ldd", f], env=env).stdout):
            out.setdefault(soname, []).append(Path(f).name)
    return out


def _find_lib(staging: Path, soname: str) -> Path | None:
    hits = sorted(staging.glob(f"**/{soname}"))
    return hits[0] if hits else None


def versions(install: SlurmInstall) -> dict:
    env = {**os.environ, **install.env()}
    slurmd = run([str(install.which("slurmd")), "-V"], env=env)
    munged = run([str(install.which("munged")), "--version"], env=env)
    return {"slurmd": (slurmd.stdout + slurmd.stderr).strip(),
            "munged": (munged.stdout + munged.stderr).strip()}  # fmt: skip
