"""The augmentation draws (hpc_ddp/train/crop_draws.py): one sample's and a whole epoch's agree,
they are a function of (seed, epoch, index) only, spread over every outcome, and both data paths
(and the image folder's) take theirs from it, without a generator per sample."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from hpc_ddp.train import crop_draws
from hpc_ddp.train.cifar.data import CifarTensors
from hpc_ddp.train.fast import gpu_data

N = 50_000  # a CIFAR epoch


def _lowbias32(x: int) -> int:
    """The mixer written the plain way, on Python's unbounded ints reduced mod 2**32."""
    m = 0xFFFF_FFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_the_mixer_is_lowbias32_without_overflow() -> None:
    words = [0, 1, 2, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFE, 0xFFFF_FFFF, 0x1234_5678]
    assert [crop_draws._mix(w) for w in words] == [_lowbias32(w) for w in words]
    tensor = crop_draws._mix(torch.tensor(words, dtype=torch.int64))
    assert tensor.tolist() == [_lowbias32(w) for w in words]


def test_one_sample_and_a_whole_epoch_draw_the_same() -> None:
    indices = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    batched = crop_draws.draws(indices, seed=7, epoch=3, span=9)
    assert batched.dtype == torch.int64 and batched.shape == (N, 3)
    single = [crop_draws.draw(i, seed=7, epoch=3, span=9) for i in indices[:2000].tolist()]
    assert batched[:2000].tolist() == [list(d) for d in single]
    # A sample's draw is the same whatever else is drawn with it (where an epoch resumes).
    assert torch.equal(crop_draws.draws(indices[1234:], seed=7, epoch=3, span=9), batched[1234:])


def test_draws_are_deterministic_and_change_with_seed_epoch_and_index() -> None:
    indices = torch.arange(N)
    base = crop_draws.draws(indices, seed=7, epoch=3, span=9)
    assert torch.equal(base, crop_draws.draws(indices, seed=7, epoch=3, span=9))
    for other in ({"seed": 8, "epoch": 3}, {"seed": 7, "epoch": 4}, {"seed": 3, "epoch": 7}):
        changed = (crop_draws.draws(indices, span=9, **other) != base).any(dim=1)
        # Independent draws agree on all three values for 1 in 162 samples.
        assert changed.float().mean() > 0.98, other
    shifted = (crop_draws.draws(indices + 1, seed=7, epoch=3, span=9) != base).any(dim=1)
    assert shifted.float().mean() > 0.98
    # Seeds that differ only above 32 bits, or by sign, are different seeds too.
    for seed in (7 + 2**32, -7):
        assert not torch.equal(crop_draws.draws(indices, seed=seed, epoch=3, span=9), base)


def test_every_outcome_occurs_about_equally_often() -> None:
    draws = crop_draws.draws(torch.arange(N), seed=0, epoch=0, span=9)
    cells = torch.bincount(draws[:, 0] * 18 + draws[:, 1] * 2 + draws[:, 2], minlength=162)
    assert len(cells) == 162 and cells.min() > 0  # all 9 x 9 x 2 (dx, dy, flip)
    expected = N / 162
    chi2 = float(((cells - expected) ** 2 / expected).sum())
    assert chi2 < 230  # 161 degrees of freedom: p < 0.0005 beyond this for a uniform draw
    assert abs(float(draws[:, 2].float().mean()) - 0.5) < 0.01  # flip half the time
    for column in (0, 1):
        counts = torch.bincount(draws[:, column], minlength=9)
        assert len(counts) == 9 and (counts - N / 9).abs().max() < 0.05 * N / 9


@pytest.mark.parametrize("span", [1, 3, 29, 57])
def test_offsets_stay_in_their_span(span: int) -> None:
    draws = crop_draws.draws(torch.arange(5000), seed=1, epoch=2, span=span)
    assert int(draws[:, :2].min()) == 0 and int(draws[:, :2].max()) == span - 1
    assert set(draws[:, 2].tolist()) == {0, 1}


@pytest.mark.parametrize("span", [0, -1, crop_draws.MAX_SPAN + 1])
def test_a_span_out_of_range_is_refused(span: int) -> None:
    with pytest.raises(ValueError, match=f"span={span}"):
        crop_draws.draw(0, seed=0, epoch=0, span=span)
    with pytest.raises(ValueError, match=f"span={span}"):
        crop_draws.draws(torch.arange(3), seed=0, epoch=0, span=span)


def _no_generator(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("a torch.Generator per sample")


def test_both_cifar_paths_draw_from_crop_draws_without_a_generator(monkeypatch) -> None:
    """The loader's item and the GPU path's batch: crop_draws' offsets and flip, and no
    torch.Generator built per sample."""
    monkeypatch.setattr(torch, "Generator", _no_generator)
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8, generator=None)
    data = CifarTensors(images, torch.arange(40) % 10, augment=True, seed=5)
    data.epoch = 2
    params = gpu_data.augment_params(torch.arange(40), seed=5, epoch=2)
    plain = CifarTensors(images, torch.arange(40) % 10, augment=False, seed=5)
    for index in range(40):
        dx, dy, flip = crop_draws.draw(index, seed=5, epoch=2, span=9)
        assert params[index].tolist() == [dx, dy, flip]
        x, _ = plain[index]
        fill = (0 - plain.mean) / plain.std
        want = (F.pad(x - fill, (4, 4, 4, 4)) + fill)[:, dy : dy + 32, dx : dx + 32]
        want = want.flip(2) if flip else want
        assert torch.allclose(data[index][0], want, atol=1e-6)


def test_the_image_folder_draws_from_crop_draws(monkeypatch, tmp_path) -> None:
    from hpc_ddp.train import image_folder, image_synthetic

    image_synthetic.write_image_folder(
        tmp_path / "folder", classes=2, train_per_class=3, test_per_class=1, size=16
    )
    data = image_folder.ImageFolderDataset(
        tmp_path / "folder" / "train", augment=True, seed=3, normalise=False
    )
    monkeypatch.setattr(torch, "Generator", _no_generator)
    for index, epoch in itertools.product(range(len(data)), (0, 5)):
        dx, dy, flip = crop_draws.draw(index, seed=3, epoch=epoch, span=2 * 2 + 1)
        x = data.decode(data.samples[index][0])
        want = F.pad(x, (2, 2, 2, 2))[:, dy : dy + 16, dx : dx + 16]
        want = want.flip(2) if flip else want
        assert torch.equal(data._crop_flip(x, epoch, index), want)
