"""RunDirLock across real processes, and the weights fingerprint."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from hpc_ddp.checkpoint import RunDirLock, RunDirLockedError
from hpc_ddp.localslurm import wait_for
from hpc_ddp.train.fingerprint import params_sha256


def test_second_run_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    ready = tmp_path / "ready"
    holder_code = textwrap.dedent(
        f"""
        import sys, pathlib
        from hpc_ddp.checkpoint import RunDirLock
        lock = RunDirLock({str(tmp_path / "run")!r}).acquire()
        pathlib.Path({str(ready)!r}).write_text("held")
        sys.stdin.read()  # hold until the test closes stdin or kills us
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", holder_code], stdin=subprocess.PIPE)
    try:
        wait_for(ready.exists, 60, "the holder to take the lock")
        with pytest.raises(RunDirLockedError) as err:
            RunDirLock(tmp_path / "run").acquire()
        text = str(err.value)
        assert f"pid {holder.pid}" in text and socket.gethostname() in text, text
        assert err.value.hint
        # kill -9 leaves no stale lock: the OS drops it with the process.
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        with RunDirLock(tmp_path / "run") as lock:
            assert lock.held
        assert not lock.held
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_lock_is_exclusive_within_one_process_too(tmp_path):
    with RunDirLock(tmp_path) as first:
        assert first.held
        with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()}"):
            RunDirLock(tmp_path).acquire()


def test_fingerprint_ignores_ddp_prefix_and_order_but_not_values_or_dtype():
    sd = {"b": torch.arange(3.0), "a": torch.ones(2, 2, dtype=torch.bfloat16)}
    base = params_sha256(sd)
    assert base == params_sha256({"module.a": sd["a"], "module.b": sd["b"]})
    assert base != params_sha256({**sd, "b": torch.tensor([0.0, 1.0, 2.0000002])})
    assert base != params_sha256({**sd, "b": sd["b"].double()})
    assert base != params_sha256({**sd, "b": sd["b"].reshape(3, 1)})
    assert base == params_sha256({**sd, "extra": "not a tensor"})
    assert len(base) == 64
