"""Checkpointer on one rank: round trip, pruning, verification and fallback on real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_ddp.checkpoint import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    UnsafeCheckpointContentError,
)
from hpc_ddp.checkpoint.fsutil import sha256_file, write_bytes_durably
from hpc_ddp.checkpoint.manifest import build_manifest, manifest_bytes
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.train.fingerprint import params_sha256


class Logs(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def has(self, *words: str) -> bool:
        return any(all(w in line for w in words) for line in self)


def model(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"module.fc.weight": torch.randn(8, 4, generator=g), "module.fc.bias": torch.zeros(8)}


def save(ck: Checkpointer, step: int, **meta: object) -> Path:
    return ck.save(
        step,
        shared={"model": model(step), "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}},
        per_rank={"rng": torch.get_rng_state(), "rank": ck.rank},
        meta={"epoch": step // 10, "model": "toy", **meta},
    )


@pytest.fixture
def ck(tmp_path: Path) -> tuple[Checkpointer, Logs]:
    logs = Logs()
    return Checkpointer(tmp_path / "run", rank=0, world_size=1, log=logs), logs


def test_round_trip_strips_ddp_prefix_and_writes_a_complete_manifest(ck):
    c, _ = ck
    rng_before = torch.get_rng_state()
    path = save(c, 120)
    assert path == c.root / "step-00000120" and path.is_dir()
    assert (c.root / "latest").read_text() == "step-00000120\n"
    loaded = c.load_latest()
    assert loaded is not None and loaded.path == path and loaded.step == 120
    assert sorted(loaded.shared["model"]) == ["fc.bias", "fc.weight"]
    assert params_sha256(loaded.shared["model"]) == params_sha256(model(120))
    assert torch.equal(loaded.per_rank["rng"], rng_before) and loaded.per_rank["rank"] == 0
    m = loaded.manifest
    assert (m["step"], m["epoch"], m["world_size"], m["meta"]["model"]) == (120, 12, 1, "toy")
    assert set(m["versions"]) == {"torch", "python", "hpc_ddp"}
    for name, entry in m["files"].items():  # the manifest describes the bytes on disk
        assert sha256_file(path / name) == (entry["size"], entry["sha256"])
    assert sorted(os.listdir(path)) == ["manifest.json", "rank-00000.pt", "shared.pt"]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keeps_the_newest_k(tmp_path, keep):
    c = Checkpointer(tmp_path, rank=0, world_size=1, keep=keep, log=Logs())
    for step in (10, 20, 30, 40):
        save(c, step)
    left = sorted(p.name for p in tmp_path.glob("step-*"))
    assert left == [f"step-{s:08d}" for s in (10, 20, 30, 40)[-keep:]]
    assert c.load_latest().step == 40


def test_keep_zero_is_refused_with_a_hint(tmp_path):
    with pytest.raises(CheckpointError, match="keep=0") as err:
        Checkpointer(tmp_path, rank=0, world_size=1, keep=0)
    assert err.value.hint


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path) -> None:
    m = json.loads(path.read_text())
    m["meta"]["epoch"] = 99  # a valid JSON edit: only the self-checksum can notice
    path.write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("target", "damage", "reason"),
    [
        ("shared.pt", _truncate, "truncated"),
        ("rank-00000.pt", _flip_byte, "sha256"),
        ("shared.pt", os.unlink, "missing"),
        ("manifest.json", _edit_manifest, "own checksum"),
        ("manifest.json", _truncate, "not valid JSON"),
        ("manifest.json", os.unlink, "never finished"),
    ],
)
def test_damaged_newest_falls_back_to_previous_and_says_why(ck, target, damage, reason):
    c, logs = ck
    save(c, 10)
    save(c, 20)
    damage(c.root / "step-00000020" / target)
    loaded = c.load_latest()
    assert loaded.step == 10
    assert params_sha256(loaded.shared["model"]) == params_sha256(model(10))
    assert logs.has("skipping step-00000020", reason), logs
    assert logs.has("fell back to step-00000010"), logs


@pytest.mark.parametrize("pointer", [b"\xff\xfe garbage", b"../../etc/passwd\n", b""])
def test_corrupt_latest_pointer_scans_step_directories(ck, pointer):
    c, logs = ck
    save(c, 10)
    save(c, 20)
    (c.root / "latest").write_bytes(pointer)
    assert c.load_latest().step == 20
    assert logs.has("trying every step directory"), logs


def test_pointer_to_a_vanished_directory_uses_the_older_one(ck):
    c, logs = ck
    save(c, 10)
    save(c, 20)
    os.rename(c.root / "step-00000020", c.root / "elsewhere")
    assert c.load_latest().step == 10
    assert logs.has("step-00000020", "does not exist"), logs


def test_all_corrupt_raises_listing_every_reason(ck):
    c, _ = ck
    save(c, 10)
    save(c, 20)
    _truncate(c.root / "step-00000010" / "shared.pt")
    _flip_byte(c.root / "step-00000020" / "rank-00000.pt")
    with pytest.raises(CheckpointCorruptError) as err:
        c.load_latest()
    text = str(err.value)
    assert "step-00000010" in text and "step-00000020" in text and "HINT" in text
    assert isinstance(err.value, HpcDdpError)


def test_no_checkpoint_returns_none_and_leftovers_are_cleaned(ck):
    c, logs = ck
    assert c.load_latest() is None
    (c.root / ".tmp-step-00000050").mkdir()
    (c.root / ".tmp-step-00000050" / "shared.pt").write_bytes(b"half")
    assert c.load_latest() is None
    assert not (c.root / ".tmp-step-00000050").exists()
    assert logs.has(".tmp-step-00000050", "interrupted save")


def test_unsafe_content_is_refused_at_save_naming_the_key(ck):
    c, _ = ck
    save(c, 10)
    with pytest.raises(UnsafeCheckpointContentError, match=r"per_rank\['np_rng'\]") as err:
        c.save(20, shared={"model": model(20)}, per_rank={"np_rng": np.zeros(3)}, meta={})
    assert "numpy" in err.value.hint
    with pytest.raises(UnsafeCheckpointContentError, match=r"shared\['fn'\]"):
        c.save(20, shared={"model": model(20), "fn": print}, per_rank={}, meta={})
    with pytest.raises(CheckpointError, match="JSON"):
        c.save(20, shared={"model": model(20)}, per_rank={}, meta={"t": torch.zeros(1)})
    assert sorted(p.name for p in c.root.iterdir()) == ["latest", "step-00000010"]
    assert c.load_latest().step == 10


class Payload:
    """Unpickling this would run code: create a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickled_code_in_a_checkpoint_is_refused_without_running_it(ck, tmp_path):
    """A checkpoint with a valid manifest whose payload holds an arbitrary object."""
    c, logs = ck
    save(c, 10)
    evil = c.root / "step-00000020"
    evil.mkdir()
    marker = tmp_path / "code-ran"
    files = {
        "shared.pt": write_bytes_durably(evil / "shared.pt", _pickled({"x": Payload(str(marker))})),
        "rank-00000.pt": write_bytes_durably(evil / "rank-00000.pt", _pickled({})),
    }
    m = build_manifest(20, 1, {"model": "toy"}, files)
    write_bytes_durably(evil / "manifest.json", manifest_bytes(m))
    (c.root / "latest").write_text("step-00000020\n")
    assert c.load_latest().step == 10
    assert not marker.exists(), "torch.load ran code from the checkpoint"
    assert logs.has("step-00000020", "weights_only"), logs


def _pickled(obj: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_other_model_is_a_clear_mismatch(ck):
    c, _ = ck
    save(c, 10)
    with pytest.raises(CheckpointMismatchError) as err:
        c.load_latest(expect={"model": "resnet18"})
    assert "'toy'" in str(err.value) and "'resnet18'" in str(err.value)
    assert c.load_latest(expect={"model": "toy", "world_size": 1}).step == 10


def test_same_step_saved_again_replaces_it(ck):
    c, _ = ck
    save(c, 10)
    save(c, 10, note="again")
    loaded = c.load_latest()
    assert loaded.step == 10 and loaded.meta["note"] == "again"
    assert sorted(p.name for p in c.root.iterdir()) == ["latest", "step-00000010"]


def test_bad_rank_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="rank 2 is not in a world of size 2"):
        Checkpointer(tmp_path, rank=2, world_size=2)


def test_everything_the_save_check_accepts_loads_with_weights_only(ck):
    """The save-time allowlist must not drift from what weights_only=True rebuilds."""
    from collections import OrderedDict

    c, _ = ck
    odd = {
        "bytes": b"x",
        "complex": 1 + 2j,
        "nested": (1, [2.5, None], {"k": True}),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "param": torch.nn.Parameter(torch.ones(2)),
        "ordered": OrderedDict(a=1),
        "int_keys": {3: "three"},
        "inf": float("inf"),
    }
    c.save(1, shared={"model": model(1), "odd": odd}, per_rank={"odd": odd}, meta={})
    loaded = c.load_latest()
    assert loaded.step == 1
    for part in (loaded.shared["odd"], loaded.per_rank["odd"]):
        assert part["nested"] == odd["nested"] and part["size"] == odd["size"]
        assert part["dtype"] is torch.bfloat16 and part["int_keys"] == {3: "three"}
