"""NCCL flight recorder: the variables rendered GPU jobs set, and `hpc-ddp doctor --nccl-dump`.

Real dumps: with the variables a GPU job sets, torch's flight recorder records Gloo collectives
too, so 2 real Gloo ranks (tests/workers/fr_hang_worker.py) hang for real (one rank skips the
last all-reduce) and write torch's own dump bytes where dump-on-timeout would; the real CLI
reads them. What only NCCL on GPUs produces (no GPU here) is built by the test: pickles of the
plain data torch's c10d FlightRecorder writes, for the states Gloo never records (``started``,
``completed``), all ranks stuck in one collective, and NCCL's spellings (``nccl:``,
``comm_lib_version``). The refusal of a pickle that would run code is real.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from trainer_helpers import job_env as process_env

from hpc_ddp.cluster.master_port import free_port
from hpc_ddp.deploy.flight_recorder import flight_recorder_env, read_dump, report
from hpc_ddp.deploy.sbatch.render import job_env
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.paths import NCCL_TRACE

REPO = Path(__file__).resolve().parents[1]
TORCH_DIST = "/venv/lib/python3.12/site-packages/torch/distributed"
HANG_WORKER = Path(__file__).parent / "workers" / "fr_hang_worker.py"


def _entry(seq: int, state: str, op: str = "nccl:all_reduce") -> dict:
    return {
        "record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
        "profiling_name": op, "time_created_ns": 1_700_000_000_000 + seq,
        "duration_ms": 1.5, "input_sizes": [[2_359_296]], "input_dtypes": ["Float"],
        "output_sizes": [[2_359_296]], "output_dtypes": ["Float"], "state": state,
        "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
        "retired": state == "completed", "timeout_ms": 600_000, "is_p2p": False,
        "frames": [  # innermost first, as torch lists them
            {"name": "all_reduce", "filename": f"{TORCH_DIST}/distributed_c10d.py", "line": 3906},
            {"name": "step", "filename": "/home/u/train.py", "line": 120},
        ],
    }  # fmt: skip


def _dump(entries: list[dict]) -> bytes:
    data = {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
        "comm_lib_version": "2.27.5",
        "pg_status": {"0": {"last_enqueued_collective": entries[-1]["collective_seq_id"]}},
        "entries": entries,
    }
    return pickle.dumps(data)


def _hang(run_dir: Path) -> Path:
    """4 ranks: 0, 1, 3 wait in all-reduce #8; rank 2 last entered #7 (and completed it)."""
    dumps = run_dir / NCCL_TRACE
    dumps.mkdir(parents=True)
    for rank in range(4):
        entries = [_entry(s, "completed") for s in range(1, 8)]
        if rank != 2:
            entries.append(_entry(8, "started"))
        (dumps / f"rank_{rank}").write_bytes(_dump(entries))
    (run_dir / "progress.json").write_text(
        json.dumps({"status": "training", "epoch": 1, "step": 4})
    )
    return dumps


def test_report_names_the_lagging_rank_the_collective_and_the_step(tmp_path: Path) -> None:
    lines = report(_hang(tmp_path / "run"))
    text = "\n".join(lines)
    assert "4 flight recorder dump(s)" in lines[0] and "(version 2.10, comm lib 2.27.5)" in lines[0]
    assert "rank 0: entered #8 nccl:all_reduce sizes=[[2359296]] (started); completed #7" in text
    assert "rank 2: entered #7 nccl:all_reduce sizes=[[2359296]] (completed)" in text
    assert (
        "ranks [2] lag: last entered #7, the others wait in #8 "
        "(nccl:all_reduce called at /home/u/train.py:120 in step)"
    ) in text
    assert "global step 4 (epoch 1)" in text


def test_all_ranks_stuck_in_one_collective_points_at_the_network(tmp_path: Path) -> None:
    dumps = tmp_path / "d"
    dumps.mkdir()
    for rank in range(2):
        (dumps / f"rank_{rank}").write_bytes(_dump([_entry(1, "completed"), _entry(2, "started")]))
    assert (
        "all ranks reached collective #2 (nccl:all_reduce called at /home/u/train.py:120 in step)"
        " and it did not complete"
    ) in "\n".join(report(dumps))


def test_dumps_without_entries_say_so(tmp_path: Path) -> None:
    dumps = tmp_path / "d"
    dumps.mkdir()
    for rank in range(2):
        (dumps / f"rank_{rank}").write_bytes(pickle.dumps({"version": "2.10", "entries": []}))
    lines = report(dumps)
    assert lines[1:3] == ["rank 0: no collective recorded", "rank 1: no collective recorded"]
    assert "no rank recorded a collective" in lines[3]


def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path: Path) -> None:
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):  # what a hostile "dump" holds: a call to os.system
            return (os.system, (f"touch {canary}",))

    bad = tmp_path / "rank_0"
    bad.write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    with pytest.raises(ConfigError, match=r"refused (posix|os)\.system"):
        read_dump(bad)
    assert not canary.exists()
    escape = _entry(1, "started", op="nccl:\x1b]0;owned\x07all_reduce")  # a terminal escape
    (tmp_path / "rank_2").write_bytes(_dump([escape]))
    shown = read_dump(tmp_path / "rank_2").groups["0 (default_pg)"].last.op
    assert shown == "nccl:?]0;owned?all_reduce"
    (tmp_path / "rank_1").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="not a readable flight recorder dump"):
        read_dump(tmp_path / "rank_1")
    with pytest.raises(ConfigError, match="no flight recorder dump"):
        report(tmp_path / "missing")


# ------------------------------------------------------------------- hostile dumps
# Each is written to rank_0 and read by the real CLI in a child whose address space is capped at
# MEMORY_CAP: a reader that builds what a dump only claims fails there instead of taking the
# machine. Every one used to end in a traceback, a crash, a hang, or 50-230 times the file's
# size in memory.
MEMORY_CAP = 1 << 30
_LAUGHS = [0]
for _ in range(6):  # 100**6 paths to one leaf: a few hundred bytes of pickle
    _LAUGHS = [_LAUGHS] * 100


def _dump_of(**entry: object) -> Callable[[], bytes]:
    return lambda: _dump([{**_entry(1, "started"), **entry}])


HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    # 9 bytes of BINBYTES8: the C unpickler allocated all 4.2 GB before reading
    "bytes8-claims-4.2GB": (
        lambda: b"\x8e" + struct.pack("<Q", 4_200_000_000),
        "expected 4200000000 bytes in a bytes8, but only 0 remain",
    ),
    "3M-empty-dicts": (lambda: b"(" + b"}" * 3_000_000 + b"l.", "times its size in memory"),
    "1M-empty-sets": (lambda: b"\x80\x04(" + b"\x8f" * 1_000_000 + b"l.", "EMPTY_SET"),
    # hash() of a tuple nested a million deep, as a dict key: the interpreter crashed
    "deep-tuple-as-key": (
        lambda: b"\x80\x02}" + b")" + b"\x85" * 1_000_000 + b"K\x01s.",
        "containers nested more than 32 deep",
    ),
    "seq-of-8M-bits": (
        _dump_of(collective_seq_id=1 << 8_000_000),
        "an integer of 8000001 bits, more than the 64",
    ),
    "seq-infinite": (_dump_of(collective_seq_id=float("inf")), "collective_seq_id inf is not a"),
    "one-entry-300k-times": (
        lambda: _dump([_entry(1, "started")] * 300_000),
        "300000 entries, more than the 200000",
    ),
    "5000-process-groups": (
        lambda: pickle.dumps({"entries": [{"pg_id": i} for i in range(5000)]}),
        "more than 1024 process groups",
    ),
}


def _read_capped(dump: Path) -> subprocess.CompletedProcess[str]:
    """``hpc-ddp doctor --nccl-dump DUMP`` in a child with MEMORY_CAP of address space, which
    prints its peak resident memory (KiB) last on stderr: VmHWM, this process image's own.
    (getrusage's ru_maxrss also keeps the peak of the image before exec, the forking test
    worker's, which made the figure that worker's size under pytest-xdist.)"""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_CAP}, {MEMORY_CAP}))\n"
        "from hpc_ddp.cli import main\n"
        "try:\n"
        f"    rc = main(['doctor', '--nccl-dump', {str(dump)!r}])\n"
        "finally:\n"
        "    status = open('/proc/self/status').read()\n"
        "    peak = int(status.split('VmHWM:')[1].split()[0])\n"
        "    print('PEAK_KB', peak, file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def _peak_mb(done: subprocess.CompletedProcess[str]) -> float:
    return int(re.findall(r"PEAK_KB (\d+)", done.stderr)[-1]) / 1024


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_dump_is_refused_by_name_in_bounded_memory(tmp_path: Path, name: str) -> None:
    build, said = HOSTILE[name]
    dump = tmp_path / "rank_0"
    dump.write_bytes(build())
    size_mb = dump.stat().st_size / 2**20
    done = _read_capped(dump)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{dump}: " in done.stderr and said in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    # an interpreter, and at most 24 times the file (plain_pickle.Limits), not what it claims
    assert _peak_mb(done) < 80 + 24 * size_mb, (_peak_mb(done), size_mb)


def test_a_file_larger_than_any_dump_is_refused_unread(tmp_path: Path) -> None:
    """A sparse 1.5 GB rank_0: its size is checked before a byte is read (it was read whole,
    past the memory cap here, before the size check)."""
    dump = tmp_path / "rank_0"
    with dump.open("wb") as f:
        f.truncate(1_500_000_000)
    done = _read_capped(dump)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "1500000000 bytes, larger than the 33554432" in done.stderr, done.stderr
    assert _peak_mb(done) < 80, _peak_mb(done)


def test_shared_sizes_nested_without_end_are_shown_short(tmp_path: Path) -> None:
    """input_sizes sharing one list 100 times per level, 6 levels: 10**12 leaves to str()
    (which never ended), shown a few items and levels deep."""
    dumps = tmp_path / "d"
    dumps.mkdir()
    for rank in range(2):
        entries = [_entry(1, "completed"), {**_entry(2, "started"), "input_sizes": _LAUGHS}]
        (dumps / f"rank_{rank}").write_bytes(_dump(entries))
    done = _read_capped(dumps)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("rank 0: entered #2"))
    assert "sizes=[[[[..., ..., " in line and len(line) < 400, line
    assert _peak_mb(done) < 100, _peak_mb(done)


def test_a_rank_that_recorded_nothing_is_named_as_the_one_behind(tmp_path: Path) -> None:
    """A real hang leaves ``entries: []`` on a rank that never reached its first collective
    (torch's own bytes, from a process without a process group); the others waited in #8. It
    was an IndexError traceback."""
    dumps = _hang(tmp_path / "run")
    empty = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from torch._C._distributed_c10d import _dump_fr_trace; "
            "sys.stdout.buffer.write(_dump_fr_trace(True, True, False))",
        ],
        capture_output=True,
        env=process_env(TORCH_FR_BUFFER_SIZE="2000"),
        timeout=120,
        check=True,
    ).stdout
    assert pickle.loads(empty)["entries"] == []  # what torch writes then
    (dumps / "rank_2").write_bytes(empty)
    text = _doctor(dumps)
    assert "rank 2: no collective recorded" in text, text
    assert "ranks [2] recorded no collective while the others did" in text, text
    assert "rank 0: entered #8 nccl:all_reduce" in text, text
    assert "all ranks reached" not in text  # one did not


def _doctor(dumps: Path) -> str:
    """``hpc-ddp doctor --nccl-dump DUMPS``'s output; fails if it imported torch."""
    code = (
        "import sys; from hpc_ddp.cli import main; rc = main(['doctor', '--nccl-dump', "
        f"{str(dumps)!r}]); assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_doctor_reads_a_dump_without_importing_torch(tmp_path: Path) -> None:
    assert "ranks [2] lag" in _doctor(_hang(tmp_path / "run"))


def _real_hang(run_dir: Path, world: int = 2) -> None:
    """The worker's ranks with the project's launcher variables and the flight recorder
    variables a GPU job sets (dumps to <run_dir>/nccl_trace/rank_N); rank 1 lags."""
    port, before_hang = free_port(), ("--dump-before-hang", str(run_dir / "before_hang"))
    recorder = flight_recorder_env(str(run_dir))
    procs = [
        subprocess.Popen(
            [sys.executable, str(HANG_WORKER), *("--run-dir", str(run_dir)), *before_hang],
            env=process_env(**_rank_env(rank, world, port), **recorder),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * world, outs


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        "HPC_DDP_STARTED_BY": "pdsh",
        "HPC_DDP_NODE_RANK": "0",
        "HPC_DDP_NUM_NODES": "1",
        "HPC_DDP_LOCAL_RANK": str(rank),
        "HPC_DDP_LOCAL_WORLD_SIZE": str(world),
        "HPC_DDP_MASTER_ADDR": "127.0.0.1",
        "HPC_DDP_MASTER_PORT": str(port),
    }


def test_a_real_gloo_hang_names_the_lagging_rank_the_collective_and_the_step(
    tmp_path: Path,
) -> None:
    """Torch-written dumps of a real hang: rank 1 skipped step 4's first all-reduce (#8 of the
    default group, whose #1 is init_distributed's own) after a collective on a second group (its
    own #1); Gloo leaves every entry "scheduled" and marks finished ones retired."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _real_hang(run_dir)
    dumps = run_dir / NCCL_TRACE
    assert sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"]
    out = _doctor(dumps)
    assert re.match(
        rf"2 flight recorder dump\(s\) in {re.escape(str(dumps))} \(version \d+\.\d+\)\n", out
    )
    default = out[out.index("process group 0 (default_pg):") : out.index("process group 1")]
    assert "rank 0: entered #8 gloo:all_reduce sizes=[[1000]] (scheduled); completed #7 " in default
    assert "rank 1: entered #7 gloo:all_reduce sizes=[[10]] (completed); completed #7 " in default
    assert (
        "ranks [1] lag: last entered #7, the others wait in #8 "
        f"(gloo:all_reduce called at {HANG_WORKER}:"
    ) in default
    side = out[out.index("process group 1") : out.index("training:")]
    assert "all ranks completed collective #1: no collective was pending" in side
    assert f"training: rank 0 last reported global step 3 (epoch 0) in {run_dir}" in out
    before = "\n".join(report(run_dir / "before_hang"))
    assert "all ranks completed collective #7: no collective was pending" in before, before


def test_gpu_jobs_switch_the_recorder_on_with_dumps_in_the_run_dir() -> None:
    gpu = dict(job_env(JobSpec(gpus_per_node=4, args=["--run-dir", "runs/a"])))
    assert gpu["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert gpu["TORCH_FR_DUMP_TEMP_FILE"] == f"runs/a/{NCCL_TRACE}/rank_"
    cpu = dict(job_env(JobSpec(args=["--run-dir", "runs/a"])))
    assert not any(k.startswith("TORCH_FR_") for k in cpu)  # Gloo has no flight recorder
    own = dict(job_env(JobSpec(gpus_per_node=1, env={"TORCH_FR_BUFFER_SIZE": "0"})))
    assert own["TORCH_FR_BUFFER_SIZE"] == "0"  # the spec's env wins
    assert flight_recorder_env(None)["TORCH_FR_DUMP_TEMP_FILE"] == (f"{NCCL_TRACE}/rank_")


def test_the_variables_are_the_ones_torch_reads() -> None:
    """The names are checked against the installed torch's libraries, not remembered."""
    torch_lib = Path(sys.executable).parents[1] / "lib"
    libs = list(torch_lib.glob("python3*/site-packages/torch/lib/libtorch_c*.so"))
    if not libs:
        pytest.skip("torch's shared libraries are not installed next to this interpreter")
    for name in flight_recorder_env(None):
        assert any(_holds(lib, name.encode() + b"\x00") for lib in libs), name


def _holds(lib: Path, needle: bytes) -> bool:
    with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(needle) >= 0
