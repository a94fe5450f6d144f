"""Checkpoint reading under hostile files: FIFOs, device nodes, symlinks, crafted manifests, an
unwritable run directory, and a signal while a real trainer loads them.

Everything is real: FIFOs made with mkfifo, a character device node with /dev/zero's numbers
(the tests run as root), manifests re-hashed so that only the schema check can catch them, the
unprivileged user ``nobody`` for the read-only run directory, real processes and real signals.
Each load runs in a child process with its memory capped and a deadline, so a read that blocks
or never ends fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from ckpt_support import Counter
from hostile_files import make_fifo, make_zero_device, run_child, symlink_to
from trainer_helpers import (
    HPC_DDP,
    finish,
    interrupt_at,
    job_env,
    single_cmd,
    start,
    train_args,
)

from hpc_ddp.checkpoint import Checkpointer, RunDirLock
from hpc_ddp.checkpoint.manifest import _self_hash
from hpc_ddp.localslurm import wait_for

# Loads each run directory given in turn, in one interpreter (one torch import); a load still
# running after HANG_S seconds is interrupted by SIGALRM and reported as hung.
HANG_S = 10
LOAD = f"""
import json, signal, sys
from pathlib import Path
from hpc_ddp.checkpoint import Checkpointer

class Hung(BaseException):
    pass

def hung(*_):
    raise Hung()

signal.signal(signal.SIGALRM, hung)
roots = sys.argv[1:]
checkpointers = [Checkpointer(Path(r), rank=0, world_size=1, log=print) for r in roots]
cap_memory()
results = {{}}
for root, ck in zip(roots, checkpointers):
    logs = []
    ck.log = logs.append
    signal.alarm({HANG_S})
    try:
        loaded = ck.load_latest()
        out = {{"step": None if loaded is None else loaded.step}}
    except BaseException as exc:
        out = {{"error": type(exc).__name__, "message": str(exc)[:400]}}
    finally:
        signal.alarm(0)
    out["logs"] = logs
    results[root] = out
print(json.dumps(results))
"""


def save(ck: Checkpointer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ck.save(
        step,
        shared={"model": {"w": torch.randn(4, 4, generator=g)}},
        per_rank={"rng": torch.get_rng_state()},
        meta={"model": "toy"},
    )


def two_checkpoints(root: Path) -> Path:
    """Two good checkpoints in ``root``: step 10 and step 20 (``latest``)."""
    ck = Checkpointer(root, rank=0, world_size=1, log=lambda _: None)
    save(ck, 10)
    save(ck, 20)
    return ck.root


def rehash(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Edit step 20's manifest and fix its self-checksum, as someone who read the code would."""

    def damage(root: Path) -> None:
        path = root / "step-00000020" / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest)
        manifest["manifest_sha256"] = _self_hash(manifest)
        path.write_text(json.dumps(manifest))

    return damage


def pad_manifest(root: Path) -> None:
    """Still the valid manifest, followed by 17 MiB of JSON whitespace."""
    path = root / "step-00000020" / "manifest.json"
    path.write_bytes(path.read_bytes() + b" " * (17 << 20))


def in_step_20(name: str, make: Callable[[Path], object]) -> Callable[[Path], None]:
    return lambda root: make(root / "step-00000020" / name)


def world_size(value: object) -> Callable[[dict], None]:
    return lambda m: m.update(world_size=value)


HOSTILE = {
    # input: (damage, the step that must load, what the log must say)
    "latest is a FIFO": (lambda r: make_fifo(r / "latest"), 20, "a FIFO, not a regular file"),
    "latest -> /dev/zero": (lambda r: symlink_to(r / "latest", "/dev/zero"), 20, "symbolic link"),
    "latest is a char device": (lambda r: make_zero_device(r / "latest"), 20, "character device"),
    "manifest is a FIFO": (in_step_20("manifest.json", make_fifo), 10, "manifest.json: a FIFO"),
    "manifest -> /dev/zero": (
        in_step_20("manifest.json", lambda p: symlink_to(p, "/dev/zero")),
        10,
        "manifest.json: a symbolic link",
    ),
    "manifest over 16 MiB": (pad_manifest, 10, "larger than the 16777216 bytes"),
    "shared.pt is a FIFO": (in_step_20("shared.pt", make_fifo), 10, "shared.pt: a FIFO"),
    "shared.pt -> /dev/zero": (
        in_step_20("shared.pt", lambda p: symlink_to(p, "/dev/zero")),
        10,
        "shared.pt: a symbolic link",
    ),
    "rank file is a char device": (
        in_step_20("rank-00000.pt", make_zero_device),
        10,
        "rank-00000.pt: a character device",
    ),
    "rehashed world_size 10**12": (
        rehash(world_size(10**12)),
        10,
        "it lists 2 files for a world of 1000000000000 ranks",
    ),
    "rehashed world_size 0": (rehash(world_size(0)), 10, "world_size is 0, not an integer >= 1"),
    "rehashed world_size missing": (
        rehash(lambda m: m.pop("world_size")),
        10,
        "world_size is None",
    ),
    "rehashed files missing": (
        rehash(lambda m: m.pop("files")),
        10,
        "files is not a JSON object",
    ),
    "rehashed extra file ../../etc/passwd": (
        rehash(lambda m: m["files"].update({"../../etc/passwd": {"size": 1, "sha256": "0" * 64}})),
        10,
        "it lists 3 files for a world of 1 ranks",
    ),
    "rehashed sha256 not hex": (
        rehash(lambda m: m["files"]["shared.pt"].update(sha256="../" * 20)),
        10,
        "has no sha256 of 64 hex digits",
    ),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case of HOSTILE, each in its own run directory, loaded by one child process."""
    roots = {}
    for i, (case, (damage, _, _)) in enumerate(HOSTILE.items()):
        if "char device" in case and os.geteuid() != 0:
            continue  # making a device node needs root
        roots[case] = two_checkpoints(tmp_path_factory.mktemp(f"case{i}") / "ckpt")
        damage(roots[case])
    results = run_child(LOAD, *map(str, roots.values()), timeout=60 + HANG_S * len(roots))
    return {case: results[str(root)] for case, root in roots.items()}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_checkpoint_files_are_refused_without_reading_and_the_load_falls_back(
    outcomes: dict[str, dict], case: str
) -> None:
    if case not in outcomes:
        pytest.skip("making a device node needs root")
    _, step, reason = HOSTILE[case]
    out = outcomes[case]
    assert "error" not in out, out
    assert out["step"] == step, out
    assert any(reason in line for line in out["logs"]), out["logs"]
    if step == 10:
        assert any("skipping step-00000020" in line for line in out["logs"]), out["logs"]


# ------------------------------------------------------------------------- run directory lock
def _world_readable_dir() -> Path:
    """A directory ``nobody`` can reach (pytest's tmp_path is root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="hpcddp-ro-"))
    path.chmod(0o755)
    return path


@pytest.fixture
def read_only_run_dir() -> Iterator[Path]:
    top = _world_readable_dir()
    run_dir = top / "run"
    run_dir.mkdir(mode=0o755)  # root's: not writable by nobody
    yield run_dir
    subprocess.run(["rm", "-rf", str(top)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the user nobody needs root")
def test_read_only_run_dir_is_a_clear_error_exit_2(read_only_run_dir: Path) -> None:
    """`hpc-ddp train` as the unprivileged user nobody, in a run directory it cannot write."""
    data = read_only_run_dir.parent / "data"
    data.mkdir(mode=0o777)
    data.chmod(0o777)
    cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
    cmd += [HPC_DDP, "train", *train_args(read_only_run_dir, data)]
    env = job_env(HOME=str(data), MPLCONFIGDIR=str(data))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"run directory {read_only_run_dir} is not writable by this user (uid 65534)" in (
        done.stderr
    )
    assert "HINT: make it writable by this user" in done.stderr and "--run-dir" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_symlink_planted_as_the_owner_file_is_replaced_not_written_through(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("not the toolkit's")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".run.lock.owner").symlink_to(victim)
    with RunDirLock(run_dir):
        owner = run_dir / ".run.lock.owner"
        assert not owner.is_symlink() and json.loads(owner.read_text())["pid"] == os.getpid()
    assert victim.read_text() == "not the toolkit's"


CONTEND = """
import json, sys
from hpc_ddp.checkpoint import RunDirLock, RunDirLockedError
try:
    RunDirLock(sys.argv[1]).acquire()
    out = {"error": None}
except RunDirLockedError as exc:
    out = {"error": str(exc)}
print(json.dumps(out))
"""


def test_a_fifo_as_the_owner_file_does_not_hang_the_refusal(tmp_path: Path) -> None:
    with RunDirLock(tmp_path / "run"):
        make_fifo(tmp_path / "run" / ".run.lock.owner")
        out = run_child(CONTEND, str(tmp_path / "run"), timeout=60)
    assert out["error"] and "owner unknown" in out["error"], out


def test_an_owner_file_of_the_wrong_shape_names_no_one(tmp_path: Path) -> None:
    with RunDirLock(tmp_path / "run"):
        (tmp_path / "run" / ".run.lock.owner").unlink()
        (tmp_path / "run" / ".run.lock.owner").write_text("[1, 2]")
        out = run_child(CONTEND, str(tmp_path / "run"), timeout=60)
    assert out["error"] and "owner unknown" in out["error"], out
    assert socket.gethostname() not in out["error"]


# ------------------------------------------------------------------- a signal while loading
PROMPT_S = 5.0  # SIGTERM -> exit, with a load, one step and a checkpoint in between


def test_sigterm_while_a_run_loads_hostile_checkpoints_ends_it_promptly(
    tmp_path: Path, data_dir: Path
) -> None:
    """A real `hpc-ddp train` resumes from a run directory where ``latest`` is a FIFO and the
    newest checkpoint's shared.pt is one too (the old reader blocked in open() forever, and the
    handler only set a flag). SIGTERM, sent when the trainer starts loading, must end it with
    exit 75 within PROMPT_S seconds, after it skipped both and resumed from the older one."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir, checkpoint_every_steps=2)
    rc, log = interrupt_at(
        single_cmd([*args, "--debug-hold-at-step", "5"]),
        run_dir,
        tmp_path / "first.log",
        signal.SIGTERM,
    )
    assert rc == 75, log
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text() == "step-00000005\n"
    make_fifo(ckpt / "latest")
    make_fifo(ckpt / "step-00000005" / "shared.pt")

    log_path = tmp_path / "second.log"
    # The hold only keeps a signal that came late from finding the run finished.
    proc = start(single_cmd([*args, "--debug-hold-at-step", "20"]), log_path)
    try:
        wait_for(lambda: "data: " in log_path.read_text(), 90, "the trainer to reach its load")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc, log = finish(proc, log_path, timeout=PROMPT_S)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 75, log
    assert took < PROMPT_S, f"{took:.1f} s"
    assert "latest: a FIFO, not a regular file" in log, log
    assert "skipping step-00000005: cannot read shared.pt: a FIFO" in log, log
    assert "resumed from" in log and "step 4)" in log and "preempted (SIGTERM)" in log, log
    print(f"SIGTERM -> exit 75 in {took:.2f} s", file=sys.stderr)


# --- the sharded (DCP) payload --------------------------------------------------------------
class _Plant:
    """Unpickling this creates a file: a .metadata that runs code on load."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _sharded_pair(root: Path) -> Checkpointer:
    """Two sharded checkpoints (DCP payload, one rank): step 10 and step 20 (``latest``)."""
    ck = Checkpointer(root, rank=0, world_size=1, sharded=True, log=lambda _: None)
    for step in (10, 20):
        state = {"model": {"w": torch.full((4, 4), float(step))}, "opt": {"lr": 0.5, "n": step}}
        ck.save(step, shared=state, per_rank={"rng": torch.get_rng_state()}, meta={})
    return ck


def _plant_metadata(root: Path, planted: Path) -> None:
    import pickle

    from hpc_ddp.checkpoint.fsutil import sha256_file

    meta = root / "step-00000020" / "dcp" / ".metadata"
    meta.write_bytes(pickle.dumps(_Plant(planted)))
    size, digest = sha256_file(meta)
    rehash(lambda m: m["files"]["dcp/.metadata"].update(size=size, sha256=digest))(root)


SHARDED_HOSTILE = {
    # input: (damage(root, planted file), what the log must say)
    ".metadata unpickles code (manifest re-hashed to match)": (
        _plant_metadata,
        "is not part of a checkpoint's metadata",
    ),
    "a shard file is a FIFO": (
        lambda r, _p: make_fifo(_replace(r / "step-00000020" / "dcp" / "__0_0.distcp")),
        "dcp/__0_0.distcp: a FIFO",
    ),
    "dcp -> another checkpoint's dcp": (
        lambda r, _p: symlink_to(
            _replace(r / "step-00000020" / "dcp"), r / "step-00000010" / "dcp"
        ),
        "dcp is not a directory",
    ),
    "rehashed extra file dcp/../../etc/passwd": (
        lambda r, _p: rehash(
            lambda m: m["files"].update({"dcp/../../etc/passwd": {"size": 1, "sha256": "0" * 64}})
        )(r),
        "not a file of a sharded checkpoint",
    ),
    "rehashed unknown payload": (
        lambda r, _p: rehash(lambda m: m.update(payload="pickle"))(r),
        "payload is 'pickle'",
    ),
}


def _replace(path: Path) -> Path:
    """``path`` removed, to be planted again by the caller."""
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path)
    else:
        path.unlink()
    return path


@pytest.mark.parametrize("case", list(SHARDED_HOSTILE))
def test_hostile_sharded_checkpoints_are_refused_and_the_load_falls_back(
    tmp_path: Path, case: str
) -> None:
    damage, said = SHARDED_HOSTILE[case]
    ck, planted = _sharded_pair(tmp_path / "ckpt"), tmp_path / "code-ran"
    damage(ck.root, planted)
    logs: list[str] = []
    ck.log = logs.append
    into = {"model": {"w": torch.zeros(4, 4)}, "opt": {"lr": 0.0, "n": 0}}
    loaded = ck.load_latest(sharded_into=into)
    assert loaded is not None and loaded.step == 10, logs
    assert torch.equal(into["model"]["w"], torch.full((4, 4), 10.0)) and into["opt"]["n"] == 10
    assert not planted.exists()
    assert any(said in line for line in logs), logs


def _planted_state(planted: Path) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(_Plant(planted), buffer)
    return buffer.getvalue()


# What a sharded checkpoint holds for an object that is not sharded (a scheduler, the trainer's
# progress): the bytes of its state dict (hpc_ddp.runtime.sharded_state.opaque).
OPAQUE_HOSTILE = {
    "its bytes unpickle code": (_planted_state, "'progress' cannot be read as a state dict"),
    "not bytes": (lambda _p: 7, "'progress' is a int, not a state saved by"),
}


@pytest.mark.parametrize("case", list(OPAQUE_HOSTILE))
def test_hostile_unsharded_state_in_a_sharded_checkpoint_is_refused(
    tmp_path: Path, case: str
) -> None:
    from hpc_ddp.checkpoint.errors import CheckpointError
    from hpc_ddp.runtime.sharded_state import ShardedState

    value, said = OPAQUE_HOSTILE[case]
    planted = tmp_path / "code-ran"
    ck = Checkpointer(tmp_path / "ckpt", rank=0, world_size=1, sharded=True, log=lambda _: None)
    ck.save(3, shared={"progress": value(planted)}, per_rank={}, meta={})
    state = ShardedState({"progress": Counter()})
    into = state.state_dict()
    assert ck.load_latest(sharded_into=into) is not None
    with pytest.raises(CheckpointError, match=said):
        state.load_state_dict(into)
    assert not planted.exists() and state.objects["progress"].n == 0
