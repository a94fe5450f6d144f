"""Trainer building blocks, in-process: sampler, config, data staging, models, RNG, preemption."""

from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from hpc_ddp import exit_codes, slurm_client
from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime import preemption, rng
from hpc_ddp.runtime.shard_plan import ShardPlan, epoch_permutation, eval_indices, rank_indices
from hpc_ddp.train import config as cfgmod
from hpc_ddp.train.cifar import data, models, synthetic
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast import array_cache


# ------------------------------------------------------------------------------------ sampler
@pytest.mark.parametrize("n,world", [(10, 3), (101, 2), (7, 4), (64, 2), (5, 8)])
def test_rank_indices_equal_distributed_sampler(n: int, world: int) -> None:
    for epoch in range(3):
        perm = epoch_permutation(n, seed=7, epoch=epoch)
        for rank in range(world):
            ref = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=7)
            ref.set_epoch(epoch)
            assert rank_indices(perm, rank, world).tolist() == list(ref)


def test_shard_plan_resume_is_the_tail_of_the_uninterrupted_epoch() -> None:
    plan = ShardPlan(n=103, seed=3, world_size=2, micro_batch=4, accum_steps=3)
    assert plan.steps_per_epoch() == 5  # 52 per rank, 12 per step -> 4 full + 1 short
    for rank in range(2):
        full = plan.indices(epoch=1, rank=rank).tolist()
        for done in range(plan.steps_per_epoch() + 1):
            start = plan.step_start(done)
            assert plan.steps_done(start) == done
            assert (
                plan.indices(1, rank, start).tolist()
                == full[len(full) - len(plan.indices(1, rank, start)) :]
            )
            assert len(full) - len(plan.indices(1, rank, start)) == start // 2
    with pytest.raises(ValueError):
        plan.steps_done(-1)


@pytest.mark.parametrize("n,world,new_world", [(103, 2, 3), (96, 4, 2), (101, 2, 4), (7, 3, 8)])
def test_an_epoch_resumed_on_another_world_trains_on_each_sample_once(
    n: int, world: int, new_world: int
) -> None:
    """Whatever step the old world stopped at, its ranks' consumed samples and the new world's
    rest of the epoch together cover the epoch once, plus the padding that makes the new
    ranks' shares equal (fewer than new_world samples); the new world's steps end at the
    epoch's end and their positions count every sample."""
    old = ShardPlan(n=n, seed=5, world_size=world, micro_batch=4, accum_steps=2)
    new = ShardPlan(n=n, seed=5, world_size=new_world, micro_batch=3)
    for done in range(old.steps_per_epoch() + 1):
        start = old.step_start(done)
        seen = [i for r in range(world) for i in old.indices(2, r)[: start // world].tolist()]
        rest = [new.indices(2, r, start).tolist() for r in range(new_world)]
        assert len({len(share) for share in rest}) == 1  # equal shares: every rank steps alike
        seen += [i for share in rest for i in share]
        pad = (-(n - start)) % new_world if start < n else 0
        assert sorted(set(seen)) == list(range(n)) and len(seen) == max(n, start) + pad
        origin, steps = start, new.steps_done(start)
        while steps < new.steps_per_epoch():
            steps += 1
            start = new.step_start(steps, origin)
        assert start == max(origin, n + pad if origin < n else origin)
        assert new.rank_left(start) == 0


def test_eval_indices_partition_the_test_set_without_padding() -> None:
    for n, world in [(101, 2), (10, 3), (3, 4)]:
        shards = [list(eval_indices(n, r, world)) for r in range(world)]
        assert sorted(i for s in shards for i in s) == list(range(n))


# ------------------------------------------------------------------------------------- config
def test_config_file_then_flags_win(tmp_path: Path) -> None:
    import argparse

    (tmp_path / "c.json").write_text(json.dumps({"lr": 0.2, "batch-size": 8, "epochs": 4}))
    (tmp_path / "c.toml").write_text('[train]\nlr = 0.3\nmodel = "resnet18"\nepochs = 5\n')
    parser = argparse.ArgumentParser()
    cfgmod.add_arguments(parser)
    cfg = cfgmod.from_args(parser.parse_args(["--config", str(tmp_path / "c.json"), "--lr", "0.5"]))
    assert (cfg.lr, cfg.batch_size, cfg.epochs) == (0.5, 8, 4)
    cfg = cfgmod.from_args(
        parser.parse_args(["--config", str(tmp_path / "c.toml"), "--no-augment"])
    )
    assert (cfg.lr, cfg.model, cfg.epochs, cfg.augment) == (0.3, "resnet18", 5, False)
    cfg = cfgmod.from_args(parser.parse_args(["--requeue-signal", "USR2,term"]))
    assert cfg.requeue_signals == ["SIGUSR2", "SIGTERM"]


def test_cuda_graphs_setting_flags_and_files(tmp_path: Path) -> None:
    """auto by default; --cuda-graphs forces it on, --no-cuda-graphs off; a config file names
    the mode (true/false is no mode: refused)."""
    import argparse

    parser = argparse.ArgumentParser()
    cfgmod.add_arguments(parser)

    def mode(*argv: str) -> str:
        return cfgmod.from_args(parser.parse_args(list(argv))).cuda_graphs

    assert TrainConfig().cuda_graphs == mode() == "auto"
    assert mode("--cuda-graphs") == mode("--cuda-graphs", "on") == "on"
    assert mode("--no-cuda-graphs") == mode("--cuda-graphs", "off") == "off"
    assert mode("--cuda-graphs", "--no-cuda-graphs") == "off"  # the last flag wins
    assert mode("--cuda-graphs", "auto") == "auto"
    (tmp_path / "on.toml").write_text('cuda_graphs = "on"\n')
    (tmp_path / "off.json").write_text('{"cuda-graphs": "off"}')
    (tmp_path / "bool.toml").write_text("cuda_graphs = true\n")
    assert mode("--config", str(tmp_path / "on.toml")) == "on"
    assert mode("--config", str(tmp_path / "off.json")) == "off"
    assert mode("--config", str(tmp_path / "off.json"), "--cuda-graphs", "auto") == "auto"
    with pytest.raises(ConfigError, match="cuda_graphs: expected a string, got True"):
        mode("--config", str(tmp_path / "bool.toml"))
    with pytest.raises(ConfigError, match="cuda_graphs=True is not valid"):
        TrainConfig(cuda_graphs=True)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):  # argparse: exit 2 naming the choices
        parser.parse_args(["--cuda-graphs", "always"])


def test_identity_changes_name_what_differs() -> None:
    recorded = TrainConfig(epochs=3).to_dict()
    del recorded["synthetic_variant"]  # a config.json from before that setting existed
    assert TrainConfig(epochs=3, log_every=7, cuda_graphs="off").identity_changes(recorded) == {}
    assert TrainConfig(epochs=4, lr=0.5, seed=1).identity_changes(recorded) == {
        "lr": (1e-3, 0.5),
        "seed": (0, 1),
    }  # epochs is where the run ends, not which run it is: a run continues to more


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"learning_rate": 0.1}, "valid keys: run_dir"),
        ({"bach_size": 8}, "did you mean 'batch_size'"),
        ({"cuda_graphs": "always"}, "use one of: auto, on, off"),
        ({"cuda_graphs": 1}, "cuda_graphs: expected a string"),
        ({"model": "vgg"}, "use one of: lenet, resnet18"),
        ({"epochs": "3"}, "epochs: expected an integer"),
        ({"epochs": 3.0}, "epochs: expected an integer"),
        ({"batch_size": 0}, "batch_size=0 is out of range: expected an integer from 1"),
        ({"keep_checkpoints": 1}, "at least 2, so a torn newest checkpoint falls back"),
        ({"requeue_signals": ["SIGNOPE"]}, "unknown signal"),
        ({"amp": True}, "amp: expected a string"),
    ],
)
def test_bad_config_values_fail_clearly(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfgmod.from_mapping(values)
    assert needle in str(err.value)


def test_bad_config_files(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{lr: 1}")
    (tmp_path / "x.yaml").write_text("lr: 1")
    (tmp_path / "list.json").write_text("[1]")
    for name, needle in [
        ("bad.json", "invalid JSON"),
        ("x.yaml", "use .toml or .json"),
        ("list.json", "expected a table of settings"),
        ("missing.json", "does not exist"),
    ]:
        with pytest.raises(ConfigError) as err:
            cfgmod.load_file(tmp_path / name)
        assert needle in str(err.value)


# --------------------------------------------------------------------------------------- data
@pytest.mark.parametrize("dataset,classes", [("cifar10", 10), ("cifar100", 100)])
def test_synthetic_writes_the_real_on_disk_format(
    tmp_path: Path, dataset: str, classes: int
) -> None:
    cfg = TrainConfig(
        data_dir=str(tmp_path),
        dataset=dataset,
        synthetic=True,
        synthetic_train_size=53,
        synthetic_test_size=11,
    )
    root = data.stage(cfg)
    folder = root / synthetic.FOLDERS[dataset]
    expected = ["batches.meta", "test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]
    if dataset == "cifar100":
        expected = ["meta", "test", "train"]
    ours = {synthetic.MARKER, array_cache.CACHE_DIR}  # the pickles' .npy cache: array_cache.py
    assert sorted(p.name for p in folder.iterdir() if p.name not in ours) == sorted(expected)
    with open(folder / ("test_batch" if dataset == "cifar10" else "test"), "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    assert entry["data"].shape == (11, 3072) and entry["data"].dtype.name == "uint8"
    train, test, num_classes = data.load_datasets(cfg, root)  # the restricted reader
    assert (len(train), len(test), num_classes) == (53, 11, classes)
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= int(y) < classes
    mtime = (folder / expected[0]).stat().st_mtime_ns
    data.stage(cfg)  # staged once: a second call finds it and writes nothing
    assert (folder / expected[0]).stat().st_mtime_ns == mtime


def test_augmentation_is_a_function_of_seed_epoch_and_index(tmp_path: Path) -> None:
    cfg = TrainConfig(
        data_dir=str(tmp_path), synthetic=True, synthetic_train_size=20, synthetic_test_size=5
    )
    train, _, _ = data.load_datasets(cfg, data.stage(cfg))
    first = train[3][0]
    torch.manual_seed(123)  # the global RNG must not matter
    assert torch.equal(train[3][0], first)
    train.epoch = 1
    assert not torch.equal(train[3][0], first)


def test_missing_data_dir_and_missing_dataset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        data.stage(TrainConfig(data_dir=str(tmp_path / "nope")))
    assert "does not exist" in str(err.value) and "cifar-10-batches-py" in str(err.value)
    with pytest.raises(data.DataError) as err:
        data.stage(TrainConfig(data_dir=str(tmp_path), download=False))
    assert "not found" in str(err.value) and "--data-dir" in str(err.value)


def test_unreachable_download_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy on a closed local port makes the real download fail at once, as offline does."""
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(data.DataError) as err:
        data.stage(TrainConfig(data_dir=str(tmp_path), dataset="cifar100"))
    text = str(err.value)
    assert "could not download CIFAR100" in text and "--data-dir" in text
    assert "cifar-100-python/" in text


# ------------------------------------------------------------------------------------- models
def test_lenet_and_resnet_shapes() -> None:
    net = models.build_model("lenet", 10)
    shapes = [tuple(p.shape) for p in net.parameters()]
    assert shapes[0] == (6, 3, 5, 5) and shapes[2] == (16, 6, 5, 5)
    assert [s for s in shapes if len(s) == 2] == [(120, 400), (84, 120), (10, 84)]
    res = models.build_model("resnet18", 100, sync_bn=True)
    assert res(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    assert isinstance(res.stem[1], torch.nn.SyncBatchNorm)
    assert sum(p.numel() for p in models.build_model("resnet18", 10).parameters()) == 11_173_962


def test_place_model_split_keeps_names_and_outputs() -> None:
    """CPU stand-in for a multi-GPU split: two 'devices' that are both the CPU exercise the
    stage assignment and the input-moving hooks; real cross-GPU moves need GPUs (not here)."""
    assert models.split_points(8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    torch.manual_seed(0)
    ref = models.build_model("resnet18", 10).eval()
    split = models.build_model("resnet18", 10).eval()
    split.load_state_dict(ref.state_dict())
    models.place_model(split, [torch.device("cpu"), torch.device("cpu")])
    assert list(split.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(split(x), ref(x))
    with pytest.raises(ConfigError):
        models.split_points(3, 4)


# ---------------------------------------------------------------------------------------- rng
def test_rng_roundtrip_through_weights_only_load(tmp_path: Path) -> None:
    import random

    import numpy as np

    rng.seed_everything(5)
    state = rng.capture()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_rng_restores_the_python_state_of_older_checkpoints_as_a_list() -> None:
    import random

    rng.seed_everything(6)
    state = rng.capture()
    assert state["python"]["state"].dtype == torch.int64  # one tensor: cheap to pickle
    expected = random.random()
    state["python"]["state"] = state["python"]["state"].tolist()  # how they were written
    rng.restore(state)
    assert random.random() == expected


# --------------------------------------------------------------------------------- preemption
def test_signal_handler_only_sets_a_flag() -> None:
    flag = preemption.PreemptionFlag.install(["USR1", "TERM"])
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, delivered to this process
        assert flag.requested and flag.received == ["SIGUSR1"]
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_requeue_target_and_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = slurm_client.slurm_job_to_requeue
    assert job({"SLURM_JOB_ID": "12"}) == "12"
    assert (
        job({"SLURM_JOB_ID": "13", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "3"})
        == "10_3"
    )
    assert "not inside a Slurm job" in preemption.requeue("auto", {})
    assert "submitit" in preemption.requeue("auto", {"SLURM_JOB_ID": "1", "SUBMITIT_FOLDER": "x"})
    assert "requeue=none" in preemption.requeue("none", {"SLURM_JOB_ID": "1"})
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    assert "scontrol not found" in preemption.requeue("auto", {"SLURM_JOB_ID": "7"})


def test_requeue_calls_scontrol_with_the_array_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in scontrol records its argv (the real one needs a Slurm cluster: see the Slurm
    tests); this checks the exact command line the trainer runs."""
    record = tmp_path / "argv"
    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    env = {"SLURM_JOB_ID": "13", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "3"}
    assert preemption.requeue("scontrol", env) == "requeued Slurm job 10_3 (scontrol requeue)"
    assert record.read_text().split() == ["requeue", "10_3"]
    assert preemption.EXIT_REQUEUE == exit_codes.EXIT_REQUEUE == 75  # one definition


def test_official_md5_sums_are_torchvisions(tmp_path: Path) -> None:
    """data.OFFICIAL_MD5 (staging checks without importing torchvision) == torchvision's lists."""
    from torchvision.datasets import CIFAR10, CIFAR100

    for name, cls in (("cifar10", CIFAR10), ("cifar100", CIFAR100)):
        theirs = {f: m for f, m in cls.train_list + cls.test_list}
        theirs[cls.meta["filename"]] = cls.meta["md5"]
        assert data.OFFICIAL_MD5[name] == theirs
        assert synthetic.FOLDERS[name] == cls.base_folder
    # Files with other contents (here: synthetic ones) do not pass for the official set.
    synthetic.write_synthetic(tmp_path, "cifar100", train_size=5, test_size=3)
    assert not data._present("cifar100", tmp_path)


def test_agreement_schedule_bounds_the_steps_to_a_preemption() -> None:
    """k = steps between two preemption agreements: ~AGREE_TARGET_S of training, 1..MAX steps."""
    from hpc_ddp.train.trainer import AGREE_MAX_STEPS, AGREE_TARGET_S, AgreeSchedule

    agree = AgreeSchedule(world_size=4)
    assert agree.due(1, requested=False)  # the first step after a (re)start agrees
    assert agree.interval(-1.0) == 1  # pace unknown (warm-up): every step
    assert agree.interval(10.0) == 1  # slow steps: every step
    assert agree.interval(AGREE_TARGET_S / 10.5) == 10
    assert agree.interval(1e-6) == AGREE_MAX_STEPS  # fast steps: capped
    for pace in (1e-6, 1e-4, 3e-3, 0.05, 0.2, 1.0):
        k = agree.interval(pace)
        assert 1 <= k <= AGREE_MAX_STEPS and (k == 1 or k * pace <= AGREE_TARGET_S)
    agree.synced(7, pace=AGREE_TARGET_S / 10.5)
    assert next(s for s in range(8, 30) if agree.due(s, requested=True)) == 17  # flag ignored
    # One process has no one to agree with: its own flag, at every step boundary.
    alone = AgreeSchedule(world_size=1)
    assert not alone.due(5, requested=False) and alone.due(6, requested=True)


# ------------------------------------------------------------------------------- run clocks
def test_a_resume_continues_both_clocks_from_the_checkpoint(tmp_path: Path) -> None:
    """The run's wall time and its training loop's both go on from the checkpoint's values:
    result.json's figures cover every attempt, not only the last. A real save and restore
    (resume.save/restore through the trainer's Resumable); the clocks' starts are set, so the
    sums are exact."""
    from types import SimpleNamespace

    from hpc_ddp import Resumable
    from hpc_ddp.train.loop import Times
    from hpc_ddp.train.progress import Progress
    from hpc_ddp.train.resume import Clock, restore, save

    def state() -> SimpleNamespace:  # the parts of a TrainState that save and restore read
        net = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        stepper = SimpleNamespace(
            optimizer=opt,
            scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
            scaler=torch.amp.GradScaler("cpu", enabled=False),
        )
        progress = Progress()
        run = Resumable(
            tmp_path,
            signals=[],
            restore=False,
            log=lambda _: None,
            model=net,
            optimizer=opt,
            scheduler=stepper.scheduler,
            scaler=stepper.scaler,
            progress=progress,
        )
        plan = ShardPlan(n=8, seed=0, world_size=1, micro_batch=2)
        return SimpleNamespace(run=run, net=net, stepper=stepper, progress=progress, plan=plan)

    first, before = Clock(), state()
    assert first.loop_elapsed() == 0.0  # the loop has not started: nothing counted yet
    first.start_loop()
    now = time.perf_counter()  # the first attempt: 100 s in all, 60 of them in the loop
    first.started, first.loop_started = now - 100.0, now - 60.0
    cfg = TrainConfig(async_checkpoint=False)
    before.progress.global_step = 7
    save(before, cfg, before.progress, Times(), first)  # type: ignore[arg-type]

    second = Clock()
    restored = restore(state(), cfg, 1, second)  # type: ignore[arg-type]
    assert restored.global_step == 7 and restored.interruptions == 1
    assert 100.0 <= restored.wall_seconds < 101.0 and 60.0 <= restored.train_wall_seconds < 61.0
    assert (second.base, second.loop_base) == (restored.wall_seconds, restored.train_wall_seconds)
    assert second.loop_elapsed() == restored.train_wall_seconds  # not started in this attempt
    second.start_loop()
    assert restored.train_wall_seconds <= second.loop_elapsed() < second.elapsed()
