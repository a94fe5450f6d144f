"""FSDP2 (fully_shard) with hpc_ddp.Resumable: sharded checkpoints through
torch.distributed.checkpoint under the project's commit protocol.

Real torchrun, real Gloo ranks on CPU (tests/workers/fsdp_worker.py), real signals: a run
preempted mid-epoch (sync and async saves) resumes to the uninterrupted run's weights and
optimizer state bit for bit; a rank SIGKILLed inside a save leaves the previous checkpoint
committed; a torn shard file falls back to the previous checkpoint; a checkpoint written by 2
ranks loads into 1 and one written by 1 into 2 with the same parameters. The GPU tests (bf16
mixed precision, NCCL, 2 GPUs) skip where fewer than two CUDA GPUs are visible.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import TORCHRUN, run

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "tests" / "workers" / "fsdp_worker.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
STEPS = 48  # 3 epochs of 512 samples, batch 16, at 2 ranks


def torchrun(world: int, run_dir: Path, out: Path, *extra: str, timeout: float = 180):
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={world}", WORKER]
    return run([*cmd, "--run-dir", str(run_dir), "--out", str(out), *extra], timeout=timeout)


def forked(world: int, run_dir: Path, out: Path, *extra: str, timeout: float = 180):
    """The same ranks forked from one interpreter after its imports (hpc_ddp.spawn): about half
    torchrun's start-up on this machine, for the runs whose launcher is not what is tested."""
    cmd = [sys.executable, WORKER, "--nproc", str(world)]
    return run([*cmd, "--run-dir", str(run_dir), "--out", str(out), *extra], timeout=timeout)


def same_state(a: Path, b: Path) -> None:
    """The gathered model and optimizer states of two runs are equal, bit for bit."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x["model"].keys() == y["model"].keys()
    for key in y["model"]:
        assert torch.equal(x["model"][key], y["model"][key]), key
    sx, sy = x["optimizer"]["state"], y["optimizer"]["state"]
    assert sx.keys() == sy.keys() and sy
    for name in sy:
        for key in sy[name]:
            assert torch.equal(sx[name][key], sy[name][key]), (name, key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The uninterrupted 2-rank run: its gathered state and its run directory."""
    d = tmp_path_factory.mktemp("fsdp-ref")
    done = torchrun(2, d / "run", d / "state.pt")
    assert done.returncode == 0, done.stdout + done.stderr
    return d / "state.pt", d / "run"


def test_sharded_checkpoint_is_written_by_every_rank_under_the_manifest(
    reference: tuple[Path, Path],
) -> None:
    root = reference[1] / "checkpoints"
    assert (root / "latest").read_text() == f"step-{STEPS:08d}\n"
    step = root / f"step-{STEPS:08d}"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["payload"] == "dcp" and manifest["world_size"] == 2
    assert set(manifest["files"]) == {
        "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rank-00000.pt", "rank-00001.pt"
    }  # fmt: skip
    assert not (step / "shared.pt").exists()  # no rank holds, or writes, the whole state
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000032", "step-00000048"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_preempted_fsdp_run_resumes_bit_identical(
    reference: tuple[Path, Path], tmp_path: Path, mode: str
) -> None:
    """SIGUSR1 at step 21 (mid-epoch 2): checkpoint, exit 75; the rerun ends as the reference.
    Async: a save every 5 steps in the background, one in flight when the signal comes."""
    extra = ["--async", "--checkpoint-every", "5"] if mode == "async" else []
    launch = forked if mode == "async" else torchrun
    first = launch(2, tmp_path / "run", tmp_path / "x.pt", *extra, "--preempt-at", "21")
    assert first.returncode != 0, first.stdout  # torchrun reports the workers' 75 as 1
    assert "preempted at step 21: checkpointed" in first.stdout, first.stdout + first.stderr
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-00000021\n"
    again = launch(2, tmp_path / "run", tmp_path / "state.pt", *extra)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "step-00000021: epoch 2, step 21" in again.stdout, again.stdout
    same_state(tmp_path / "state.pt", reference[0])


def test_rank_killed_inside_a_save_and_a_torn_shard_fall_back(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed once its shards of step 32 are written: step 16 stays committed and
    the rerun resumes from it; then the newest checkpoint's shard file is truncated: the next
    load skips it, names why, and falls back."""
    first = forked(2, tmp_path / "run", tmp_path / "x.pt", "--kill-at-save", "32")
    assert first.returncode != 0
    assert "lost contact with the other ranks while saving step 32" in first.stdout + first.stderr
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000016"]
    again = forked(2, tmp_path / "run", tmp_path / "state.pt")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "step-00000016: epoch 2, step 16" in again.stdout
    same_state(tmp_path / "state.pt", reference[0])

    shard = root / f"step-{STEPS:08d}" / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    load = forked(1, tmp_path / "run", tmp_path / "loaded.pt", "--load-only")
    assert load.returncode == 0, load.stdout + load.stderr
    assert "dcp/__1_0.distcp has" in load.stdout and "(truncated?)" in load.stdout, load.stdout
    assert "fell back to step-00000032" in load.stdout
    assert "loaded step 32 saved by 2 ranks" in load.stdout


def test_two_ranks_checkpoint_loads_into_one_and_one_into_two(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """DCP reshards: the gathered state after loading equals the saver's, bit for bit. The
    1-rank load checkpoints what it loaded, from its world of 1, for the 2-rank load."""
    one = tmp_path / "one"
    down = forked(1, reference[1], tmp_path / "down.pt", "--load-only", "--save-as", str(one))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "loaded step 48 saved by 2 ranks" in down.stdout
    same_state(tmp_path / "down.pt", reference[0])
    assert (
        json.loads((one / "checkpoints" / "step-00000048" / "manifest.json").read_text())[
            "world_size"
        ]
        == 1
    )

    up = forked(2, one, tmp_path / "up.pt", "--load-only")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "loaded step 48 saved by 1 ranks" in up.stdout
    same_state(tmp_path / "up.pt", reference[0])


FRESH_THEN_GROWN = """
import sys, torch, torch.distributed as dist, hpc_ddp
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)

class Counters:  # a loop's own state, whose shape changes as it runs
    def __init__(self):
        self.seen, self.last = [], None
    def state_dict(self):
        return {"seen": list(self.seen), "last": self.last}
    def load_state_dict(self, state):
        self.seen, self.last = state["seen"], state["last"]

def build():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(net[0])
    fully_shard(net)
    return net, torch.optim.AdamW(net.parameters(), lr=0.1), Counters()

net, opt, counters = build()
run = hpc_ddp.Resumable(sys.argv[1], model=net, optimizer=opt, counters=counters)
print("fresh optimizer state:", len(opt.state))
net(torch.ones(2, 4)).sum().backward()
opt.step()
counters.seen.append({"step": 1})
counters.last = {"loss": 0.5}
run.save()
net, opt, counters = build()  # a new attempt's objects: nothing seen, no last value
hpc_ddp.Resumable(sys.argv[1], model=net, optimizer=opt, counters=counters)
print("restored:", counters.seen, counters.last, [int(s["step"]) for s in opt.state.values()])
"""


def test_resumable_fsdp_starts_fresh_and_restores_counters_that_grew(tmp_path: Path) -> None:
    """A run with no checkpoint starts with an empty optimizer state (DCP's load target, made
    for a checkpoint there is none of, would step the optimizer once); an object that is not
    sharded is restored whatever shape its state took since it was built (DCP alone loads only
    the keys of the fresh object's state)."""
    code = [sys.executable, "-c", FRESH_THEN_GROWN, str(tmp_path / "run"), str(tmp_path / "s")]
    done = run(code, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fresh optimizer state: 0" in done.stdout, done.stdout
    assert "restored: [{'step': 1}] {'loss': 0.5} [1, 1, 1, 1]" in done.stdout, done.stdout


# --- GPUs: NCCL, bf16 mixed precision -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, {GPUS} visible")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gpu_fsdp_bf16_preempted_resumes_bit_identical(tmp_path: Path, mode: str) -> None:
    extra = ["--cuda", *(["--async", "--checkpoint-every", "5"] if mode == "async" else [])]
    ref = torchrun(2, tmp_path / "ref", tmp_path / "ref.pt", *extra)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    first = torchrun(2, tmp_path / "run", tmp_path / "x.pt", *extra, "--preempt-at", "21")
    assert "preempted at step 21: checkpointed" in first.stdout, first.stdout + first.stderr
    again = torchrun(2, tmp_path / "run", tmp_path / "state.pt", *extra)
    assert again.returncode == 0, again.stdout + again.stderr
    same_state(tmp_path / "state.pt", tmp_path / "ref.pt")
    down = torchrun(1, tmp_path / "run", tmp_path / "down.pt", "--cuda", "--load-only")
    assert down.returncode == 0, down.stdout + down.stderr
    same_state(tmp_path / "down.pt", tmp_path / "ref.pt")


WHOLE_THEN_SHARDED = """
import sys, torch, torch.distributed as dist, hpc_ddp
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
net = torch.nn.Linear(4, 4)
hpc_ddp.Resumable(sys.argv[1], model=net).save()  # a whole (shared.pt) checkpoint
fully_shard(net)
try:
    hpc_ddp.Resumable(sys.argv[1], model=net)
except hpc_ddp.HpcDdpError as err:
    print(str(err).replace("\\n", " "))
"""


def test_a_whole_checkpoint_is_refused_for_a_sharded_model(tmp_path: Path) -> None:
    """Not silently resumed with the fresh weights: the run says which kind it found."""
    code = [sys.executable, "-c", WHOLE_THEN_SHARDED, str(tmp_path / "run"), str(tmp_path / "s")]
    done = run(code, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "holds a whole (unsharded) state, and this run's model is sharded" in done.stdout
