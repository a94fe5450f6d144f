"""Image folders from disk (``--dataset imagefolder``, train/image_folder.py): the synthetic
generator, the loader's defaults, the starvation line's decision, exact resume of a 2-rank run
over a generated PNG folder (real forked ranks, real Gloo, a real signal mid-epoch), a plug-in
image-folder dataset, and hostile files (a non-image, an image that does not decode) each
named in a clear error. Nothing is mocked; the starvation decision is tested on injected
figures, so no assertion depends on timing.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from trainer_helpers import (
    assert_resumed_like,
    forked_cmd,
    forked_script,
    interrupt_at,
    read_result,
    reference_run,
    run,
    single_cmd,
    train_args,
)

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.train import data_wait, image_folder, image_synthetic, loader_settings
from hpc_ddp.train.loader_data import EpochIndex, FailedItem

# 8 classes x 16 training images of 32 px: 128 samples, 4 steps an epoch on 2 ranks x 16.
CLASSES, PER_CLASS, TEST_PER_CLASS, SIZE = 8, 16, 5, 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images") / "set"
    return image_synthetic.write_image_folder(
        root, classes=CLASSES, train_per_class=PER_CLASS, test_per_class=TEST_PER_CLASS, size=SIZE
    )


def folder_settings() -> dict[str, object]:
    """trainer_helpers.SMALL's run on the image folder ``data`` (given as --data-dir)."""
    return {"dataset": "imagefolder", "synthetic": False, "epochs": 3,
            "synthetic_train_size": None, "synthetic_test_size": None}  # fmt: skip


# --- the generator ---------------------------------------------------------------------------


def test_the_generator_writes_an_image_folder_deterministically(tmp_path: Path) -> None:
    kind = {"classes": 3, "train_per_class": 2, "test_per_class": 1, "size": 24}
    a = image_synthetic.write_image_folder(tmp_path / "a", **kind)
    b = image_synthetic.write_image_folder(tmp_path / "b", **kind, processes=2)
    files = sorted(p.relative_to(a) for p in a.rglob("*.png"))
    assert len(files) == 3 * (2 + 1)
    assert files[0] == Path("test/class_000/000000.png")
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    train = image_folder.ImageFolderDataset(a / "train", normalise=False)
    assert train.classes == ["class_000", "class_001", "class_002"] and train.size == 24
    x, label = train.item(0)
    assert x.dtype == torch.uint8 and x.shape == (3, 24, 24) and label == 0
    # A folder it did not write is never replaced.
    (tmp_path / "mine").mkdir()
    with pytest.raises(HpcDdpError, match="not a synthetic image folder"):
        image_synthetic.write_image_folder(tmp_path / "mine", **kind)


# --- augmentation: a function of (seed, epoch, index) ----------------------------------------


def test_augmentation_depends_on_seed_epoch_and_index_only(folder: Path) -> None:
    data = image_folder.ImageFolderDataset(folder / "train", augment=True, seed=3, normalise=False)
    a = data.item(EpochIndex(5, 2))[0]
    again = pickle.loads(pickle.dumps(data)).item(pickle.loads(pickle.dumps(EpochIndex(5, 2))))[0]
    assert torch.equal(a, again)  # in another process's copy (what a worker holds) too
    epochs = [data.item(EpochIndex(5, e))[0] for e in range(8)]
    assert any(not torch.equal(a, other) for other in epochs[3:])


def test_the_crop_window_is_the_crop_of_the_zero_padded_image() -> None:
    """image_folder.window spares the padded copy; every offset gives what padding gave."""
    import torch.nn.functional as F

    x = torch.randint(1, 256, (3, 8, 8), dtype=torch.uint8, generator=torch.Generator())
    padded = F.pad(x, (2, 2, 2, 2))
    for dy in range(5):
        for dx in range(5):
            want = padded[:, dy : dy + 8, dx : dx + 8]
            assert torch.equal(image_folder.window(x, dy - 2, dx - 2), want), (dy, dx)


def test_the_dataloader_gives_the_same_batches_whatever_its_workers(folder: Path) -> None:
    from hpc_ddp.runtime.shard_plan import ShardPlan
    from hpc_ddp.train.loader_data import LoaderTrainData

    data = image_folder.ImageFolderDataset(folder / "train", augment=True, seed=1, normalise=False)
    plan = ShardPlan(n=len(data), world_size=2, micro_batch=16, accum_steps=1, seed=1)
    cpu = torch.device("cpu")

    def epochs(workers: int) -> list[torch.Tensor]:
        settings = loader_settings.LoaderSettings(workers, False, 2, "test", False)
        loader = LoaderTrainData(plan, data, 1, cpu, settings=settings)
        return [x for e in (0, 1) for x, _ in loader.batches(e, 32 if e else 0)]

    main, two = epochs(0), epochs(2)
    assert len(main) == 4 + 3  # epoch 1 resumed at sample 32: the first step done
    assert all(torch.equal(a, b) for a, b in zip(main, two, strict=True))


class _Logged(torch.utils.data.Dataset):
    """Appends "epoch index" to a file for each item a worker reads."""

    epoch_indices = True

    def __init__(self, n: int, log: Path) -> None:
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with self.log.open("a") as out:
            out.write(f"{getattr(index, 'epoch', -1)} {int(index)}\n")
        return torch.full((2,), float(index)), int(index) % 3


def test_workers_decode_the_next_epoch_before_it_is_asked_for(tmp_path: Path) -> None:
    """One iterator streams across epoch ends: after an epoch's last batch, the workers go on
    with the next epoch's first ones (an epoch's start no longer waits on an empty queue), and
    each epoch still gets exactly its own batches, as a run with no workers gets them."""
    from hpc_ddp.polling import wait_for
    from hpc_ddp.runtime.shard_plan import ShardPlan
    from hpc_ddp.train.loader_data import LoaderTrainData

    plan = ShardPlan(n=40, world_size=2, micro_batch=4, accum_steps=1, seed=5)
    cpu = torch.device("cpu")

    def loader(workers: int, log: Path) -> LoaderTrainData:
        settings = loader_settings.LoaderSettings(workers, False, 2, "test", False)
        return LoaderTrainData(plan, _Logged(plan.n, log), 1, cpu, settings=settings)

    plain = loader(0, tmp_path / "plain")
    want = [[x for x, _ in plain.batches(e, 0)] for e in range(3)]
    streamed = loader(2, tmp_path / "log")
    got = [[x for x, _ in streamed.batches(0, 0)]]
    next_epoch = {f"1 {i}" for i in plan.indices(1, 1).tolist()[:4]}  # its first batch

    def read_ahead() -> bool:
        return bool(next_epoch & set((tmp_path / "log").read_text().splitlines()))

    wait_for(read_ahead, 30, "the workers to read epoch 2's first batch")
    got += [[x for x, _ in streamed.batches(e, 0)] for e in (1, 2)]
    assert [len(g) for g in got] == [5, 5, 5]
    pairs = [(a, b) for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True)]
    assert all(torch.equal(a, b) for a, b in pairs)


def test_persistent_workers_see_each_epoch_of_the_cifar_tensors() -> None:
    """CifarTensors' augmentation depends on the epoch; persistent workers hold the copy of the
    dataset made when they started, so the epoch must come with each index."""
    from hpc_ddp.runtime.shard_plan import ShardPlan
    from hpc_ddp.train.cifar.data import CifarTensors
    from hpc_ddp.train.loader_data import LoaderTrainData

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=g)
    data = CifarTensors(images, torch.arange(64) % 10, augment=True, seed=2)
    plan = ShardPlan(n=64, world_size=1, micro_batch=16, accum_steps=1, seed=2)
    cpu = torch.device("cpu")

    def epochs(workers: int) -> list[torch.Tensor]:
        settings = loader_settings.LoaderSettings(workers, False, 2, "test", False)
        loader = LoaderTrainData(plan, data, 0, cpu, settings=settings)
        batches = []
        for epoch in (0, 1, 2):
            data.epoch = epoch  # what cifar.data.LoaderTrainData does: seen by the main process
            batches += [x for x, _ in loader.batches(epoch, 0)]
        return batches

    assert all(torch.equal(a, b) for a, b in zip(epochs(0), epochs(1), strict=True))


# --- loader defaults -------------------------------------------------------------------------


def test_workers_come_from_the_cores_of_this_process() -> None:
    cores = loader_settings.usable_cores()
    got = loader_settings.choose(
        None, from_disk=True, cuda=True, source="torchrun", local_world_size=1, environ={}
    )
    assert got.workers == min(max(cores - 1, 1), loader_settings.MAX_AUTO_WORKERS)
    assert got.pin_memory and got.persistent and got.chosen
    kwargs = got.loader_kwargs()
    assert kwargs["persistent_workers"] and kwargs["prefetch_factor"] == loader_settings.PREFETCH
    shared = loader_settings.choose(
        None, from_disk=True, cuda=False, source="spawn", local_world_size=64, environ={}
    )
    assert shared.cores == max(cores // 64, 1) and shared.workers == 1
    assert "processes on this node" in shared.cores_from
    slurm = loader_settings.process_cores("slurm", 4, {"SLURM_CPUS_PER_TASK": "1"})
    assert slurm == (1, "SLURM_CPUS_PER_TASK=1") if cores > 1 else slurm[0] == 1
    memory = loader_settings.choose(
        None, from_disk=False, cuda=False, source="single", local_world_size=1, environ={}
    )
    assert memory.workers == 0 and "persistent_workers" not in memory.loader_kwargs()
    given = loader_settings.choose(
        3, from_disk=True, cuda=False, source="single", local_world_size=1, environ={}
    )
    assert given.workers == 3 and not given.chosen and "--num-workers" in given.describe()


# --- starvation: the decision, on injected figures -------------------------------------------

LINE = re.compile(
    r"data: the step waited for its batches (\d+) % of its time in epoch 1 \(more than 5 %\): "
    r"(\d+) samples/s per decode core x (\d+) = (\d+) samples/s, with (\d+) core\(s\) for this "
    r"process \(.+\); the step takes (\d+) samples/s, which needs about (\d+) decode cores\. "
    r"What would help: .*more --cpus-per-task.*smaller images.*pre-decoded cache.*"
)


def test_a_starved_step_is_said_with_what_would_help() -> None:
    # 10 s between batches, 8 of them waiting: 1000 samples from 2 workers.
    starved = data_wait.Waited(wait_s=8.0, span_s=10.0, samples=1000, batches=10)
    line = data_wait.advice(starved, workers=2, cores=3, cores_from="3 usable / 1 processes")
    assert line is not None
    m = LINE.fullmatch(line)
    assert m, line
    share, per_core, workers, rate, cores, step, needed = map(int, m.groups())
    assert (share, per_core, workers, rate, cores, step, needed) == (80, 50, 2, 100, 3, 500, 10)
    assert "more --num-workers" not in line  # 2 workers already use the 3 cores less one
    few = data_wait.advice(starved, workers=1, cores=8, cores_from="x")
    assert few is not None and "more --num-workers (now 1)" in few


def test_a_fed_step_says_nothing() -> None:
    fed = data_wait.Waited(wait_s=0.4, span_s=10.0, samples=1000, batches=10)  # 4 %
    assert data_wait.advice(fed, workers=2, cores=3, cores_from="x") is None
    edge = data_wait.Waited(wait_s=0.5, span_s=10.0, samples=1000, batches=10)  # 5 %: allowed
    assert data_wait.advice(edge, workers=2, cores=3, cores_from="x") is None
    assert data_wait.advice(data_wait.Waited(), workers=2, cores=3, cores_from="x") is None


def test_epoch_2_says_it_again_when_the_warmed_up_step_starves_more() -> None:
    """Epoch 1's step is slower than later ones: a loader that kept up with it may not after."""
    assert data_wait.says(1, 0.07, 0.07) and not data_wait.says(1, 0.05, 0.05)
    assert data_wait.says(2, 0.50, 0.07)  # said at 7 %, now 50 %: said again
    assert data_wait.says(2, 0.30, 0.0)  # unsaid in epoch 1 (a resumed run: no figure)
    assert not data_wait.says(2, 0.10, 0.07)  # not twice epoch 1's: nothing new to say
    assert not data_wait.says(2, 0.04, 0.0) and not data_wait.says(3, 0.90, 0.0)
    starved = data_wait.Waited(wait_s=5.0, span_s=10.0, samples=1000, batches=10)
    line = data_wait.advice(starved, workers=2, cores=3, cores_from="x", epoch=2)
    assert line is not None and "50 % of its time in epoch 2 (more than 5 %)" in line


def test_the_meter_leaves_out_the_first_batch() -> None:
    meter = data_wait.WaitMeter()
    batches = [(torch.zeros(4), torch.zeros(4)) for _ in range(3)]
    assert len(list(meter.wrap(batches))) == 3
    assert meter.latest.batches == 2 and meter.latest.samples == 8


# --- hostile input ---------------------------------------------------------------------------


def test_a_non_image_file_is_refused_naming_it(tmp_path: Path, folder: Path) -> None:
    import shutil

    data = tmp_path / "set"
    shutil.copytree(folder, data)
    notes = data / "train" / "class_003" / "notes.txt"
    notes.write_text("not an image")
    with pytest.raises(image_folder.ImageFolderError, match=re.escape(f"{notes} is not an image")):
        image_folder.scan(data / "train")
    notes.unlink()
    stray = data / "train" / "README"
    stray.write_text("a file beside the class folders")
    with pytest.raises(image_folder.ImageFolderError, match=re.escape(f"{stray} is not a folder")):
        image_folder.scan(data / "train")
    stray.unlink()
    fake = data / "train" / "class_001" / "000003.png"
    fake.write_bytes(b"GIF89a" + bytes(64))
    item = image_folder.ImageFolderDataset(data / "train")[PER_CLASS + 3]
    assert isinstance(item, FailedItem) and f"{fake} is not a readable image" in item.message


def _png_header(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR chunk claiming ``width`` x ``height`` (no pixel data)."""
    import struct
    import zlib

    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
    idat = struct.pack(">I", 0) + b"IDAT" + struct.pack(">I", zlib.crc32(b"IDAT"))
    return b"\x89PNG\r\n\x1a\n" + chunks + idat


def test_planted_files_are_refused_before_anything_is_allocated(
    tmp_path: Path, folder: Path
) -> None:
    import os
    import shutil

    data = tmp_path / "set"
    shutil.copytree(folder, data)
    bomb = data / "train" / "class_002" / "000001.png"
    train = image_folder.ImageFolderDataset(data / "train")
    for side in (10_000, 100_000):  # the second over Pillow's own bound: refused as well
        said = f"claims {side} x {side} px"
        bomb.write_bytes(_png_header(side, side))  # up to 30 GB of pixels, claimed in 45 bytes
        item = train[PER_CLASS * 2 + 1]
        assert isinstance(item, FailedItem) and f"{bomb} {said}" in item.message, item
    fifo = data / "train" / "class_004" / "000000.png"
    fifo.unlink()
    os.mkfifo(fifo)  # a reader that opened it would block until a writer came
    with pytest.raises(image_folder.ImageFolderError, match=f"{fifo} is not a regular file"):
        image_folder.scan(data / "train")
    fifo.unlink()
    shutil.rmtree(data / "test" / "class_007")
    with pytest.raises(image_folder.ImageFolderError, match="have different class folders"):
        image_folder.read_splits(_config(data), data)


def _config(data: Path):  # a TrainConfig for read_splits
    from hpc_ddp.train.config import TrainConfig

    return TrainConfig(dataset="imagefolder", data_dir=str(data))


def test_an_unreadable_image_in_a_run_is_one_error_naming_the_file(
    tmp_path: Path, folder: Path
) -> None:
    import shutil

    data = tmp_path / "set"
    shutil.copytree(folder, data)
    bad = data / "train" / "class_005" / "000007.png"
    bad.write_bytes(bad.read_bytes()[:60])  # a PNG cut short: the header reads, the pixels not
    args = train_args(tmp_path / "run", data, **{**folder_settings(), "num_workers": 1})
    done = run(single_cmd(args), timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{bad} does not decode" in done.stderr or f"{bad} is not a readable" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# --- training --------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_image_folder_run_resumed_after_a_signal_ends_bit_identical(
    tmp_path: Path, folder: Path
) -> None:
    settings = folder_settings()
    ref_dir = reference_run(tmp_path / "ref", folder, timeout=300, **settings)
    ref_log = (tmp_path / "ref" / "metrics.jsonl").read_text()
    assert ref_log.count("\n") == 3

    run_dir = tmp_path / "run"
    args = train_args(run_dir, folder, **settings)
    # 4 steps an epoch: step 6 is in the middle of epoch 2.
    rc, log = interrupt_at(
        forked_cmd(2, [*args, "--debug-hold-at-step", "6"]), run_dir, tmp_path / "1.log"
    )
    assert rc == 75 and "preempted (SIGUSR1): checkpointed at step 6" in log, log
    assert "data loader: 1 worker process(es) (chosen from the cores" in log, log
    final = run(forked_cmd(2, args), timeout=300)
    assert final.returncode == 0, final.stderr
    assert "resumed from" in final.stdout and "step 6" in final.stdout
    result = assert_resumed_like(run_dir, ref_dir, interruptions=1, steps=12)
    assert result["test_accuracy"] == read_result(ref_dir)["test_accuracy"]


def test_synthetic_writes_an_image_folder_and_trains_on_it(tmp_path: Path) -> None:
    settings = {**folder_settings(), "synthetic": True, "synthetic_train_size": 160,
                "synthetic_test_size": 40, "image_size": 32, "epochs": 1}  # fmt: skip
    done = run(forked_cmd(2, train_args(tmp_path / "run", tmp_path / "data", **settings)), 180)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = tmp_path / "data" / "synthetic-imagefolder-16-4-32px"
    assert len(list((folder / "train").glob("class_*/*.png"))) == 160
    assert f"image folder {folder}: 160 training and 40 test images of 10 classes at 32 px" in (
        done.stdout
    )


PLUGIN = """
import time
from pathlib import Path

from torch import nn

from hpc_ddp.train.image_folder import ImageFolderDataset

ROOT = Path({root!r})


def tiny(num_classes):
    return nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, num_classes))


class SlowToDecode(ImageFolderDataset):
    # Deliberately slow decoding (a large image on a slow core), so that the step starves.
    def decode(self, path):
        time.sleep(0.02)
        return super().decode(path)


def slow_images(split):
    return SlowToDecode(ROOT / split, augment=split == "train")
"""


def test_a_plugin_image_folder_trains_and_a_starved_step_is_said(
    tmp_path: Path, folder: Path
) -> None:
    plugin = tmp_path / "my_images.py"
    plugin.write_text(PLUGIN.format(root=str(folder)))
    settings = {**folder_settings(), "dataset": f"{plugin}:slow_images",
                "model": f"{plugin}:tiny", "epochs": 1, "num_workers": 1}  # fmt: skip
    done = run(single_cmd(train_args(tmp_path / "run", tmp_path / "no-data", **settings)), 180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data loader: 1 worker process(es) (--num-workers)" in done.stdout, done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("data: the step")]
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), done.stdout
    assert read_result(tmp_path / "run")["steps"] == CLASSES * PER_CLASS // 16


HELD = """
import sys

from hpc_ddp.train.cli import main
from hpc_ddp.train.fast import gpu_data

# The CPU stands in for a GPU with room: the one-time decode, its Gloo gather and the resident
# batches are all real.
gpu_data.fits_on_device = lambda nbytes, device, fraction=0.25: (True, "pretended")
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_an_image_folder_held_on_the_device_trains_as_the_streamed_one(
    tmp_path: Path, folder: Path
) -> None:
    """2 ranks: the folder decoded once (shares gathered over Gloo) and held, preempted
    mid-epoch and resumed, ends with the weights of the streamed run, bit for bit."""
    script = tmp_path / "held.py"
    script.write_text(HELD)
    settings = {**folder_settings(), "num_workers": 1}
    streamed = tmp_path / "streamed"
    done = run(forked_cmd(2, train_args(streamed, folder, **settings, data_path="torchvision")))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data: streamed from the files by the loader's workers (asked for)" in done.stdout
    assert "data loader: 1 worker process(es) (--num-workers)" in done.stdout, done.stdout

    held = tmp_path / "held"
    args = train_args(held, folder, **settings)
    rc, log = interrupt_at(
        forked_script(2, str(script), [*args, "--debug-hold-at-step", "6"]), held, tmp_path / "1"
    )
    assert rc == 75 and "checkpointed at step 6" in log, log
    said = re.search(r"data: image folder decoded once in [\d.]+ s by 1 worker a process; "
                     r"GPU-resident \(pretended\)", log)  # fmt: skip
    assert said and "data loader:" not in log, log
    final = run(forked_script(2, str(script), args), timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    assert_resumed_like(held, streamed, interruptions=1, steps=12)
