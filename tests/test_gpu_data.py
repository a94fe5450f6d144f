"""The GPU-resident data path, run on the CPU, yields exactly the torchvision path's batches.

Both paths are real and read files in CIFAR's on-disk format (written by
``synthetic.write_synthetic``) with ``data.read_arrays``, whose arrays equal what torchvision's
CIFAR10/CIFAR100 classes read; ``data.LoaderTrainData`` serves one path, ``gpu_data`` the other.
Only the device differs from a GPU run (``cpu`` here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.shard_plan import ShardPlan
from hpc_ddp.train.cifar import synthetic
from hpc_ddp.train.cifar.data import (
    CifarTensors,
    LoaderTrainData,
    dataset_class,
    eval_batches,
    load_class_names,
    load_datasets,
)
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast import gpu_data

CPU = torch.device("cpu")
TRAIN, TEST = 203, 37  # odd sizes: uneven shards, a dropped tail, a short eval batch


@pytest.fixture(scope="module", params=["cifar10", "cifar100"])
def staged(request, tmp_path_factory) -> tuple[str, Path]:
    dataset = request.param
    root = tmp_path_factory.mktemp(dataset)
    synthetic.write_synthetic(root, dataset, train_size=TRAIN, test_size=TEST)
    return dataset, root


def _paths(dataset: str, root: Path, *, world: int, rank: int, augment: bool, batch: int = 16):
    cfg = TrainConfig(dataset=dataset, synthetic=True, augment=augment, seed=7, batch_size=batch)
    train, test, _ = load_datasets(cfg, root)
    plan = ShardPlan(n=len(train), seed=cfg.seed, world_size=world, micro_batch=batch)
    loader = LoaderTrainData(plan, train, rank, CPU)
    images, labels = gpu_data.load_split(root, dataset, train=True, device=CPU)
    resident = gpu_data.GpuTrainData(
        plan=plan, images=images, labels=labels, rank=rank, augment=augment, seed=cfg.seed
    )
    return loader, resident, test


def _assert_same(a, b) -> int:
    a, b = list(a), list(b)
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype == torch.float32
        assert torch.equal(ya, yb)
        assert torch.equal(xa, xb), f"max diff {(xa - xb).abs().max()}"
    return len(a)


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (4, 0), (4, 3)])
def test_train_batches_identical(staged, world: int, rank: int, augment: bool) -> None:
    dataset, root = staged
    loader, resident, _ = _paths(dataset, root, world=world, rank=rank, augment=augment)
    for epoch in (0, 3):
        n = _assert_same(loader.batches(epoch, 0), resident.batches(epoch, 0))
        assert n == len(resident.plan.indices(epoch, rank)) // 16 + bool(
            len(resident.plan.indices(epoch, rank)) % 16
        )


def test_resume_mid_epoch_identical(staged) -> None:
    dataset, root = staged
    loader, resident, _ = _paths(dataset, root, world=2, rank=1, augment=True)
    start = 3 * 16 * 2  # three global steps in
    _assert_same(loader.batches(2, start), resident.batches(2, start))
    # ...and the resumed tail is the uninterrupted epoch's tail.
    full = list(resident.batches(2, 0))[3:]
    _assert_same(full, resident.batches(2, start))


def test_epochs_differ_and_order_is_not_identity(staged) -> None:
    dataset, root = staged
    _, resident, _ = _paths(dataset, root, world=1, rank=0, augment=False)
    y0 = torch.cat([y for _, y in resident.batches(0)])
    y1 = torch.cat([y for _, y in resident.batches(1)])
    assert not torch.equal(y0, y1)
    assert not torch.equal(y0, resident.labels[: len(y0)])


@pytest.mark.parametrize("world", [1, 3, 4])
def test_eval_batches_identical_and_exact(staged, world: int) -> None:
    dataset, root = staged
    _, _, test = _paths(dataset, root, world=world, rank=0, augment=False)
    images, labels = gpu_data.load_split(root, dataset, train=False, device=CPU)
    seen = []
    for rank in range(world):
        ours = gpu_data.GpuEvalData(images, labels, rank=rank, world_size=world).batches(10)
        _assert_same(eval_batches(test, rank, world, 10, CPU), ours)
        seen += [y for _, y in gpu_data.GpuEvalData(images, labels, rank, world).batches(10)]
    assert sum(len(y) for y in seen) == TEST  # every test sample once, none padded in


@pytest.mark.parametrize("augment", [False, True])
def test_batches_come_in_the_models_memory_format(staged, augment: bool) -> None:
    """Laid out once in channels_last (what the trainer's StepPlan.feed asks of the resident
    path), the batches are channels_last with the loader's values; a loader is left alone."""
    from hpc_ddp.train.fast.choice import StepPlan

    dataset, root = staged
    loader, resident, _ = _paths(dataset, root, world=2, rank=1, augment=augment)
    images, labels = gpu_data.load_split(root, dataset, train=False, device=CPU)
    test = gpu_data.GpuEvalData(images, labels, rank=1, world_size=2)
    plain = gpu_data.GpuEvalData(images.clone(), labels, rank=1, world_size=2)
    assert StepPlan.feed(torch.channels_last, resident, test) == (resident, test)
    assert StepPlan.feed(torch.channels_last, loader, test)[0] is loader
    for data in (resident.batches(1, 0), test.batches(10)):
        for x, _ in data:
            assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    assert _assert_same(loader.batches(1, 0), resident.batches(1, 0)) > 3
    _assert_same(plain.batches(10), test.batches(10))


def test_crop_flip_matches_pad_and_slice() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 32, 32, generator=g)
    fill = torch.tensor([-1.5, 0.25, 2.0])
    params = torch.tensor([[0, 0, 0], [8, 8, 1], [3, 5, 0], [8, 0, 1], [0, 8, 0], [4, 4, 1]])
    out = gpu_data.crop_flip(x, params, fill)
    for i, (dx, dy, flip) in enumerate(params.tolist()):
        padded = F.pad(x[i] - fill.view(3, 1, 1), (4, 4, 4, 4)) + fill.view(3, 1, 1)
        want = padded[:, dy : dy + 32, dx : dx + 32]
        if flip:
            want = want.flip(2)
        assert torch.allclose(out[i], want, atol=1e-6)


def test_fits_on_device_refuses_cpu() -> None:
    ok, why = gpu_data.fits_on_device(gpu_data.resident_bytes(50_000), CPU)
    assert not ok and "not a CUDA GPU" in why
    assert gpu_data.resident_bytes(50_000) == 50_000 * (3072 * 4 + 8)


def test_plan_size_mismatch_is_refused(staged) -> None:
    dataset, root = staged
    images, labels = gpu_data.load_split(root, dataset, train=True, device=CPU)
    plan = ShardPlan(n=TRAIN + 1, seed=0, world_size=1, micro_batch=8)
    with pytest.raises(ValueError, match="plan is for"):
        gpu_data.GpuTrainData(plan=plan, images=images, labels=labels)


def test_choose_falls_back_on_cpu_and_refuses_forced_gpu(staged) -> None:
    dataset, root = staged
    cfg = TrainConfig(dataset=dataset, synthetic=True)
    train, test, _ = load_datasets(cfg, root)
    plan = ShardPlan(n=len(train), seed=0, world_size=1, micro_batch=8)
    said: list[str] = []
    kw = {"rank": 0, "world_size": 1, "device": CPU, "log": said.append}
    data, evaluation = gpu_data.choose(cfg, plan, train, test, **kw)
    assert isinstance(data, LoaderTrainData) and "not a CUDA GPU" in said[-1]
    assert sum(len(y) for _, y in evaluation.batches(16)) == TEST
    cfg.data_path = "gpu"
    with pytest.raises(ConfigError, match="not a CUDA GPU"):
        gpu_data.choose(cfg, plan, train, test, **kw)


def _own_split(root: Path, dataset: str, *, train: bool) -> gpu_data.Split:
    images, labels = gpu_data.load_cifar_arrays(root, dataset, train=train)
    return gpu_data.Split(torch.from_numpy(images), torch.from_numpy(labels))


def test_both_readers_give_identical_arrays(staged) -> None:
    """data.read_arrays's reader of CIFAR's pickles == torchvision's CIFAR10/CIFAR100 classes."""
    from torchvision.datasets import CIFAR10, CIFAR100

    dataset, root = staged
    base = {"cifar10": CIFAR10, "cifar100": CIFAR100}[dataset]
    cls = dataset_class(dataset, is_synthetic=True)
    assert issubclass(cls, base)
    for train, n in ((True, TRAIN), (False, TEST)):
        theirs = cls(str(root), train=train, download=False)
        images, labels = gpu_data.load_cifar_arrays(root, dataset, train=train)
        assert images.dtype.name == "uint8" and images.shape == (n, 3, 32, 32)
        assert labels.dtype.name == "int64" and labels.shape == (n,)
        assert (images == theirs.data.transpose(0, 3, 1, 2)).all()  # torchvision holds NHWC
        assert labels.tolist() == list(theirs.targets)
        assert load_class_names(root, dataset) == theirs.classes
    # The trainer's read on a GPU-capable setting: the same tensors as the loader path's.
    cfg = TrainConfig(dataset=dataset, synthetic=True, seed=7)
    train_set, test_set, num_classes = load_datasets(cfg, root)
    own = [_own_split(root, dataset, train=t) for t in (True, False)]
    for ours, theirs in zip(own, (train_set, test_set), strict=True):
        assert torch.equal(ours.images, theirs.images) and torch.equal(ours.targets, theirs.targets)
    assert num_classes == len(load_class_names(root, dataset))


def test_load_splits_gives_the_loader_its_datasets(staged) -> None:
    dataset, root = staged
    cfg = TrainConfig(dataset=dataset, synthetic=True)
    train, test, num_classes = gpu_data.load_splits(cfg, root, CPU)  # CPU: the loader runs
    assert isinstance(train, CifarTensors) and isinstance(test, CifarTensors)
    assert len(train) == TRAIN and len(test) == TEST
    assert num_classes == {"cifar10": 10, "cifar100": 100}[dataset]


def test_choose_falls_back_with_arrays_read_without_torchvision(staged) -> None:
    """auto on a GPU with too little room: the arrays gpu_data read feed the loader, unchanged."""
    dataset, root = staged
    cfg = TrainConfig(dataset=dataset, synthetic=True, augment=True, seed=7)
    ref_train, ref_test, _ = load_datasets(cfg, root)
    own = [_own_split(root, dataset, train=t) for t in (True, False)]
    plan = ShardPlan(n=TRAIN, seed=cfg.seed, world_size=2, micro_batch=16)
    kw = {"rank": 1, "world_size": 2, "device": CPU, "log": lambda _: None}
    data, evaluation = gpu_data.choose(cfg, plan, *own, **kw)
    assert isinstance(data, LoaderTrainData)
    _assert_same(LoaderTrainData(plan, ref_train, 1, CPU).batches(1, 0), data.batches(1, 0))
    _assert_same(eval_batches(ref_test, 1, 2, 10, CPU), evaluation.batches(10))


GPU_PATH_RUN = r"""
import json, sys
from hpc_ddp.train.fast import gpu_data
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.trainer import train
if sys.argv[1] == "gpu":  # the GPU-resident classes, run on the CPU: pretend the device fits
    gpu_data.fits_on_device = lambda nbytes, device, fraction=0.25: (True, "pretended")
for settings in sys.argv[2:]:  # one run after the other, each with its own run dir
    result = train(TrainConfig(**json.loads(settings)))
    print(json.dumps({"sha": result.params_sha256, "loss": result.train_loss,
                      "acc": result.test_accuracy, "torchvision": "torchvision" in sys.modules}))
"""


STEP_LINES = {
    "auto": "step: as given (the model is on cpu, not a CUDA device)",
    "channels_last": "step: channels_last (2 Conv2d), AdamW as given (no CUDA device)",
}
CUDA_GRAPHS_OFF = "CUDA graphs: off (device cpu is not a CUDA GPU)"  # the step line follows it


@pytest.mark.slow
def test_gpu_resident_run_never_imports_torchvision(tmp_path: Path) -> None:
    """Whole training runs on the GPU-resident path (on the CPU), and on the loader path,
    neither importing torchvision (the files are read without it), with the same weights, loss
    and accuracy; in channels_last too (the resident path's batches come in it, the loader's
    are converted by the first convolution), said beside the CUDA graphs line. Each path's
    runs, one per memory format, share one fresh interpreter: a run after the first would
    still see torchvision in sys.modules had any run before it imported it."""
    import json
    import subprocess
    import sys

    from trainer_helpers import job_env

    out: dict[tuple[str, str], dict] = {}
    for path in ("gpu", "torchvision"):
        runs = [
            {
                "run_dir": str(tmp_path / path / memory_format),
                "data_dir": str(tmp_path / "data"),
                "synthetic": True,
                "synthetic_train_size": 96,
                "synthetic_test_size": 21,
                "epochs": 2,
                "batch_size": 16,
                "augment": True,
                "data_path": "auto" if path == "gpu" else "torchvision",
                "memory_format": memory_format,
                "plot": False,
            }
            for memory_format in sorted(STEP_LINES)
        ]
        done = subprocess.run(
            [sys.executable, "-c", GPU_PATH_RUN, path, *map(json.dumps, runs)],
            env=job_env(),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        resident = [line for line in lines if line.startswith("data: GPU-resident")]
        assert len(resident) == (len(runs) if path == "gpu" else 0), done.stdout
        graphs = [i for i, line in enumerate(lines) if line == CUDA_GRAPHS_OFF]
        results = [json.loads(line) for line in lines if line.startswith('{"sha"')]
        assert len(graphs) == len(results) == len(runs), done.stdout
        for memory_format, at, result in zip(sorted(STEP_LINES), graphs, results, strict=True):
            assert lines[at + 1] == STEP_LINES[memory_format], done.stdout
            out[path, memory_format] = result
    for memory_format in STEP_LINES:
        gpu, loader = out["gpu", memory_format], out["torchvision", memory_format]
        assert gpu["torchvision"] is False and loader["torchvision"] is False
        assert gpu["sha"] == loader["sha"], memory_format
        assert gpu["loss"] == loader["loss"], memory_format
        assert gpu["acc"] == loader["acc"], memory_format


# --- an image folder, decoded once (fast/gpu_folder.py) ----------------------------------------

# Odd counts: shares of unequal length on 2 ranks, a short last batch; 20 px: the crop pads 2.
FOLDER = {"classes": 3, "train_per_class": 7, "test_per_class": 3, "size": 20}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from hpc_ddp.train import image_synthetic

    return image_synthetic.write_image_folder(tmp_path_factory.mktemp("folder") / "f", **FOLDER)


def _folder_sets(folder: Path, *, augment: bool):
    from hpc_ddp.train.image_folder import ImageFolderDataset

    train = ImageFolderDataset(folder / "train", augment=augment, seed=7, normalise=False)
    test = ImageFolderDataset(folder / "test", seed=7, size=train.size, normalise=False)
    return train, test


def _held(folder: Path, monkeypatch, *, augment: bool, workers: int = 0):
    """Both splits through the resident path's decision and decode, on the CPU (one process:
    the gather is the identity): the device pretends to fit."""
    from hpc_ddp import Comm
    from hpc_ddp.train import loader_settings
    from hpc_ddp.train.fast import gpu_folder

    monkeypatch.setattr(gpu_data, "fits_on_device", lambda nbytes, device: (True, "pretended"))
    train, test = _folder_sets(folder, augment=augment)
    settings = loader_settings.choose(workers, from_disk=True, cuda=False, source="cli",
                                      local_world_size=1)  # fmt: skip
    said: list[str] = []
    held = gpu_folder.decode_if_held(
        "gpu", train, test, settings, device=CPU, comm=Comm(CPU), log=said.append
    )
    assert held is not None and "data: image folder decoded once in" in said[-1], said
    return train, test, held


@pytest.mark.parametrize("augment", [False, True])
def test_an_image_folder_held_gives_the_streamed_batches(folder, monkeypatch, augment) -> None:
    """GPU-resident (on a CPU tensor) == the streamed loader + Normalised, bit for bit: every
    rank of 2, two epochs, a mid-epoch resume position; the evaluation shards too."""
    from hpc_ddp.train.image_folder import Normalised
    from hpc_ddp.train.loader_data import LoaderEvalData
    from hpc_ddp.train.loader_data import LoaderTrainData as Streamed

    train, test, held = _held(folder, monkeypatch, augment=augment, workers=1)
    plan = ShardPlan(n=len(train), seed=7, world_size=2, micro_batch=4)
    for rank in (0, 1):
        ours, ours_test = held.serve(plan, rank=rank, world_size=2, device=CPU)
        streamed = Normalised(Streamed(plan, train, rank, CPU))
        for epoch, start in ((0, 0), (1, 0), (1, 8)):  # 8: a step of 2 x 4 in
            _assert_same(streamed.batches(epoch, start), ours.batches(epoch, start))
        evaluation = Normalised(LoaderEvalData(test, rank, 2, CPU))
        _assert_same(evaluation.batches(5), ours_test.batches(5))
    if augment:  # the crop and flip did move pixels
        plain = _held(folder, monkeypatch, augment=False)[2].serve(
            plan, rank=0, world_size=2, device=CPU
        )[0]
        assert not torch.equal(next(ours.batches(1, 0))[0], next(plain.batches(1, 0))[0])


def test_an_image_folder_held_is_laid_out_in_the_models_memory_format(folder, monkeypatch):
    from hpc_ddp.train.fast.choice import StepPlan

    train, _, held = _held(folder, monkeypatch, augment=True)
    plan = ShardPlan(n=len(train), seed=7, world_size=1, micro_batch=4)
    data, test = StepPlan.feed(torch.channels_last, *held.serve(plan, rank=0, world_size=1,
                                                                device=CPU))  # fmt: skip
    for x, _ in [*data.batches(0, 0), *test.batches(4)]:
        assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def test_a_file_that_does_not_decode_is_named_when_held(tmp_path, folder, monkeypatch) -> None:
    import shutil

    data = tmp_path / "f"
    shutil.copytree(folder, data)
    bad = data / "train" / "class_001" / "000004.png"
    bad.write_bytes(bad.read_bytes()[:60])  # the header reads, the pixels do not
    with pytest.raises(ConfigError, match=f"{bad} does not decode"):
        _held(data, monkeypatch, augment=False, workers=1)


def test_a_forced_gpu_folder_on_a_cpu_is_refused(folder) -> None:
    from hpc_ddp import Comm
    from hpc_ddp.train.fast import gpu_folder

    with pytest.raises(ConfigError, match="--data-path gpu: device cpu is not a CUDA GPU"):
        gpu_folder.decide("gpu", 30, 20, CPU, Comm(CPU))
    assert gpu_folder.decide("auto", 30, 20, CPU, Comm(CPU))[0] is False
    assert gpu_data.resident_bytes(10, 64) == 10 * (3 * 64 * 64 * 4 + 8)
    assert [gpu_folder.decode_batch(s) for s in (20, 64, 224, 1024)] == [256, 256, 111, 5]


def _gather_rank(rank: int, port: int, folder: str) -> None:
    """One of 2 Gloo ranks: its share of the decode, gathered, is the whole split."""
    import os

    import torch.distributed as dist

    from hpc_ddp import Comm
    from hpc_ddp.runtime.collectives import PeerFailed
    from hpc_ddp.train import loader_settings
    from hpc_ddp.train.fast import gpu_folder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    train, _ = _folder_sets(Path(folder), augment=True)
    settings = loader_settings.choose(0, from_disk=True, cuda=False, source="cli",
                                      local_world_size=2)  # fmt: skip
    share = gpu_folder.decode_share(train, rank, 2, settings)
    assert len(share) == (11 if rank == 0 else 10)  # 21 images: unequal shares
    whole = gpu_folder.gather(share, len(train), Comm(CPU))
    want = torch.stack([train.decode(path) for path, _ in train.samples])
    assert torch.equal(whole, want)
    # Only rank 1's device has room: auto holds it on neither, gpu fails on both.
    gpu_data.fits_on_device = lambda nbytes, device: (rank == 1, f"rank {rank}'s")
    ok, why = gpu_folder.decide("auto", 30, 20, CPU, Comm(CPU))
    assert not ok and why == ("rank 1's here, but not on every rank" if rank else "rank 0's")
    with pytest.raises(ConfigError if rank == 0 else PeerFailed):
        gpu_folder.decide("gpu", 30, 20, CPU, Comm(CPU))
    dist.destroy_process_group()


def test_the_ranks_shares_gather_into_the_whole_split_and_agree_where(folder) -> None:
    from trainer_helpers import spawn_ranks

    from hpc_ddp.cluster.master_port import free_port

    spawn_ranks(_gather_rank, (free_port(), str(folder)), 2)
