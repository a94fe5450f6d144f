"""NCCL flight recorder: the variables rendered GPU jobs set, and `hpc-ddp doctor --nccl-dump`.

No GPU and no NCCL here, and Gloo records no flight recorder entries, so the dumps are built by
the test: pickles of the plain data that torch's c10d FlightRecorder writes (``version``,
``pg_config``, ``entries``, each entry with the keys of its ``dump_entries``: record_id, pg_id,
process_group, collective_seq_id, profiling_name, state, input_sizes, ...). What is real: the
file format (a pickle protocol torch uses), the reader, the CLI, and the refusal of a pickle
that would run code.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.deploy.flight_recorder import flight_recorder_env, read_dump, report
from hpc_ddp.deploy.sbatch.render import job_env
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.run_paths import NCCL_TRACE

REPO = Path(__file__).resolve().parents[1]


def _entry(seq: int, state: str, op: str = "nccl:all_reduce") -> dict:
    return {
        "record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
        "profiling_name": op, "time_created_ns": 1_700_000_000_000 + seq,
        "duration_ms": 1.5, "input_sizes": [[2_359_296]], "input_dtypes": ["Float"],
        "output_sizes": [[2_359_296]], "output_dtypes": ["Float"], "state": state,
        "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
        "retired": state == "completed", "timeout_ms": 600_000, "is_p2p": False,
        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 2800}],
    }  # fmt: skip


def _dump(entries: list[dict]) -> bytes:
    data = {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
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
    assert "4 flight recorder dump(s)" in lines[0] and "version 2.10" in lines[0]
    assert "rank 0: entered #8 nccl:all_reduce sizes=[[2359296]] (started); completed #7" in text
    assert "rank 2: entered #7 nccl:all_reduce sizes=[[2359296]] (completed)" in text
    assert "ranks [2] lag: last entered #7, the others wait in #8 (nccl:all_reduce)" in text
    assert "global step 4 (epoch 1)" in text


def test_all_ranks_stuck_in_one_collective_points_at_the_network(tmp_path: Path) -> None:
    dumps = tmp_path / "d"
    dumps.mkdir()
    for rank in range(2):
        (dumps / f"rank_{rank}").write_bytes(_dump([_entry(1, "completed"), _entry(2, "started")]))
    assert "all ranks reached collective #2 (nccl:all_reduce) and it did not complete" in "\n".join(
        report(dumps)
    )


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
    (tmp_path / "rank_1").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="not a readable flight recorder dump"):
        read_dump(tmp_path / "rank_1")
    with pytest.raises(ConfigError, match="no flight recorder dump"):
        report(tmp_path / "missing")


def test_doctor_reads_a_dump_without_importing_torch(tmp_path: Path) -> None:
    dumps = _hang(tmp_path / "run")
    code = (
        "import sys; from hpc_ddp.cli import main; rc = main(['doctor', '--nccl-dump', "
        f"{str(dumps)!r}]); assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "ranks [2] lag" in done.stdout


def test_gpu_jobs_switch_the_recorder_on_with_dumps_in_the_run_dir() -> None:
    gpu = dict(job_env(JobSpec(gpus_per_node=4, args=["--run-dir", "runs/a"])))
    assert gpu["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert gpu["TORCH_FR_DUMP_TEMP_FILE"] == f"runs/a/{NCCL_TRACE}/rank_"
    cpu = dict(job_env(JobSpec(args=["--run-dir", "runs/a"])))
    assert not any(k.startswith("TORCH_FR_") for k in cpu)  # Gloo has no flight recorder
    own = dict(job_env(JobSpec(gpus_per_node=1, env={"TORCH_FR_BUFFER_SIZE": "0"})))
    assert own["TORCH_FR_BUFFER_SIZE"] == "0"  # the spec's env wins
    assert flight_recorder_env([], runs_trainer=False)["TORCH_FR_DUMP_TEMP_FILE"] == (
        f"{NCCL_TRACE}/rank_"
    )


def test_the_variables_are_the_ones_torch_reads() -> None:
    """The names are checked against the installed torch's libraries, not remembered."""
    torch_lib = Path(sys.executable).parents[1] / "lib"
    libs = list(torch_lib.glob("python3*/site-packages/torch/lib/libtorch_c*.so"))
    if not libs:
        pytest.skip("torch's shared libraries are not installed next to this interpreter")
    for name in flight_recorder_env([]):
        assert any(_holds(lib, name.encode() + b"\x00") for lib in libs), name


def _holds(lib: Path, needle: bytes) -> bool:
    with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(needle) >= 0
