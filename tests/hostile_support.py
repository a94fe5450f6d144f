"""Run a rendered script with the commands it calls replaced by stubs, and read back what ran.

What is under test is how bash (and sbatch, for ``#SBATCH`` lines) parse the text hpc-ddp
renders, so the commands the scripts call are stubs on PATH: srun, scontrol, scancel, python,
torchrun, pdsh, clush, ssh and apptainer. The stubs still hand their command on the way the real
tool would, so every quoting layer is executed: srun runs the task's argv, apptainer the command
after its image; pdsh and clush substitute %h/%n/%% and run the command once per host (pdsh
``-R exec`` as an argv, pdsh ssh and clush through a shell, ssh through ``sh -c`` as sshd
does); python and torchrun only record their
argv, working directory and environment. ``pwned`` is the injected command of every hostile
value: it creates the canary file. The directives are read by the real sbatch (``-vvv`` prints
every argument it finds in the script), stopped before it would contact a controller. The real
tools run these scripts end to end in test_slurm_jobs.py and test_launch_script.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

_RECORD = """#!/bin/bash
log="{logs}/${{0##*/}}.$$.$RANDOM"
printf '%s\\0' "$0" "$@" > "$log.argv"
"""
_PROGRAM = (
    _RECORD
    + """# the environment, NUL-separated, without forking env(1)
for v in $(compgen -e); do printf '%s=%s\\0' "$v" "${{!v}}"; done > "$log.env"
pwd > "$log.cwd"
"""
)
_SRUN = (
    _RECORD
    + """# a task runs the argv after srun's own --options
while [ $# -gt 0 ] && [[ $1 == --* ]]; do shift; done
exec "$@"
"""
)
_SSH = (
    _RECORD
    + """# sshd hands the command line to the user's shell
while [ $# -gt 0 ] && [[ $1 == -* ]]; do shift; done
shift
exec sh -c "$*"
"""
)
# pdsh (first argument -S) or clush (-R): run the command once per host, node rank = position.
_TOOL = (
    _RECORD
    + """if [ "$1" = -S ]; then tool=pdsh; else tool=clush; fi
rcmd=ssh hosts=
while [ $# -gt 0 ]; do
  case $1 in
    -S|--maxrc|--nostdin) shift ;;
    -R) rcmd=$2; shift 2 ;;
    -f|-u) shift 2 ;;
    -w) hosts=$2; shift 2 ;;
    *) break ;;
  esac
done
IFS=, read -r -a list <<< "$hosts"
pct='%%' h='%h' n='%n' rank=0 worst=0
for host in "${{list[@]}}"; do
  words=()
  for w in "$@"; do
    w=${{w//"$pct"/$'\\x01'}}; w=${{w//"$h"/$host}}; w=${{w//"$n"/$rank}}
    words+=("${{w//$'\\x01'/%}}")
  done
  if [ "$tool" = pdsh ] && [ "$rcmd" = exec ]; then
    "${{words[@]}}" 2>&1 | while IFS= read -r l; do printf '%s: %s\\n' "$host" "$l"; done
  elif [ "$tool" = pdsh ]; then
    ssh $PDSH_SSH_ARGS_APPEND "$host" "${{words[*]}}" 2>&1 |
      while IFS= read -r l; do printf '%s: %s\\n' "$host" "$l"; done
  else
    sh -c "${{words[*]}}" 2>&1 | while IFS= read -r l; do printf '%s: %s\\n' "$host" "$l"; done
  fi
  rc=${{PIPESTATUS[0]}}
  if [ "$rc" -ne 0 ]; then
    echo "$tool@stub: $host: exited with exit code $rc"
    if [ "$rc" -gt "$worst" ]; then worst=$rc; fi
  fi
  rank=$((rank + 1))
done
exit "$worst"
"""
)
# apptainer exec [options] IMAGE CMD...: runs CMD (without an image) after recording the argv.
_APPTAINER = (
    _RECORD
    + """shift
while [ $# -gt 0 ]; do case $1 in --nv) shift ;; --bind|--pwd) shift 2 ;; *) break ;; esac; done
shift
exec "$@"
"""
)
STUBS = {
    "srun": _SRUN,
    "apptainer": _APPTAINER,
    "scontrol": _RECORD + "echo node0\n",
    "scancel": _RECORD,
    "python": _PROGRAM,
    "torchrun": _PROGRAM,
    "ssh": _SSH,
    "pdsh": _TOOL,
    "clush": _TOOL,
    "pwned": _RECORD + 'touch "{canary}"\n',
}
# Enough for sbatch to read a script's directives; no controller listens on port 1.
_SLURM_CONF = """ClusterName=hostile
SlurmctldHost=localhost
SlurmctldPort=1
NodeName=node0 CPUs=1
PartitionName=p Nodes=node0 Default=YES
"""
# Contradictory command-line options: sbatch parses the script, then stops at this check.
_SBATCH_STOP = ("--deadline=now", "--begin=now+1hour")
_FOUND = re.compile(r'sbatch: debug2: Found in script, argument "(.*)"')


@dataclass(frozen=True)
class Stubs:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def canary(self) -> Path:
        return self.root / "canary"

    def exe(self, name: str) -> str:
        return str(self.bin / name)

    def env(self, **extra: str) -> dict[str, str]:
        path = f"{self.bin}:/usr/local/bin:/usr/bin:/bin"
        return {"PATH": path, "HOME": str(self.root), "LANG": "C.UTF-8", **extra}

    def reset(self) -> None:
        for entry in self.logs.iterdir():
            entry.unlink()
        self.canary.unlink(missing_ok=True)

    def calls(self) -> list[Call]:
        """Every stub call since the last reset."""
        out = []
        for argv_file in sorted(self.logs.glob("*.argv")):
            stem = str(argv_file)[: -len(".argv")]
            env_file, cwd_file = Path(stem + ".env"), Path(stem + ".cwd")
            out.append(
                Call(
                    argv=argv_file.read_bytes().split(b"\0")[:-1],
                    env=env_file.read_bytes().split(b"\0")[:-1] if env_file.exists() else [],
                    cwd=cwd_file.read_text().rstrip("\n") if cwd_file.exists() else None,
                )
            )
        return out

    def sbatch_arguments(self, script: Path) -> list[str]:
        """The arguments the real sbatch reads from the script's #SBATCH lines, in order."""
        proc = subprocess.run(
            ["sbatch", "-vvv", *_SBATCH_STOP, str(script)],
            capture_output=True,
            text=True,
            errors="surrogateescape",
            env={**self.env(), "SLURM_CONF": str(self.root / "slurm.conf")},
            timeout=30,
            check=False,
        )
        return [m.group(1) for line in proc.stderr.splitlines() if (m := _FOUND.fullmatch(line))]


@dataclass(frozen=True)
class Call:
    argv: list[bytes]
    env: list[bytes]
    cwd: str | None

    def strings(self) -> set[str]:
        items = [os.fsdecode(b) for b in (*self.argv, *self.env)]
        return {*items, *([f"cwd:{self.cwd}"] if self.cwd is not None else [])}


def make_stubs(root: Path) -> Stubs:
    stubs = Stubs(root)
    stubs.bin.mkdir(parents=True)
    stubs.logs.mkdir()
    for name, text in STUBS.items():
        exe = stubs.bin / name
        exe.write_text(text.format(logs=stubs.logs, canary=stubs.canary))
        exe.chmod(0o755)
    (root / "slurm.conf").write_text(_SLURM_CONF)
    return stubs
