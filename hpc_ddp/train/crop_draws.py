"""Each sample's random crop offsets and flip, drawn from (seed, epoch, sample index) alone.

The one owner of the augmentation draws: the loader path draws one sample at a time in a
DataLoader worker (``cifar.data.CifarTensors``, ``image_folder.ImageFolderDataset``), the
GPU-resident path draws a whole epoch's samples at once on the device (``fast.gpu_data``); both
run ``_key`` and ``_words`` below, the same integer arithmetic on Python ints or on int64 tensors,
so the two paths crop and flip every sample alike, bit for bit, and a resumed epoch redraws
exactly what the interrupted one drew.

Why a counter-based hash and not a seeded generator per sample: a generator costs a Python object
and a call per sample (a whole epoch's draws on one thread, before the epoch's first batch could
be cut on the GPU: benchmarks/NOTES.md); a hash of the counter is a few integer operations, done
for every index of an epoch as one vectorised expression, on the CPU or the GPU alike.

The hash is Chris Wellons' ``lowbias32`` mixer over 32-bit words. Every intermediate value stays
below 2**50, so no product ever overflows int64: the arithmetic is exact, and thus the same in
Python, on the CPU and on CUDA (signed overflow is what a 64-bit multiplication would risk).
"""

from __future__ import annotations

from typing import TypeVar

import torch

_M32 = 0xFFFF_FFFF
_START = 0x9E37_79B9  # any constant: the state before the first word
# One salt per drawn value, so that dx, dy and the flip come from three different hash outputs.
_SALT_DX, _SALT_DY, _SALT_FLIP = 0x68E3_1DA4, 0xB529_7A4D, 0x1B56_C4E9
MAX_SPAN = 2**16  # offsets in [0, span): far above any padding an image is cropped with

Word = TypeVar("Word", int, torch.Tensor)


def _mul32(x: Word, c: int) -> Word:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32``, in 16-bit halves of ``c``: no product
    exceeds 2**48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix(x: Word) -> Word:
    """lowbias32: a bijection of 32-bit words in which each input bit flips about half of the
    output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB_352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846C_A68B)
    return x ^ (x >> 16)


def _absorb(state: Word, value: Word) -> Word:
    """The state after one more input, taken as its low and high 32-bit words (its value modulo
    2**64: Python's ``>>`` and torch's on int64 agree for every int64, negative ones too)."""
    state = _mix(state ^ (value & _M32))
    return _mix(state ^ ((value >> 32) & _M32))


def _key(seed: int, epoch: int, index: Word) -> Word:
    """The hash of (seed, epoch, index); seed and epoch are the same for a whole epoch."""
    prefix = _absorb(_absorb(_START, seed), epoch)
    return _absorb(prefix, index)


def _words(key: Word, span: int) -> tuple[Word, Word, Word]:
    """(dx, dy, flip): offsets in [0, span) by multiply-and-shift (Lemire's reduction: no modulo,
    a bias of at most span / 2**32), the flip as one bit."""
    dx = (_mix(key ^ _SALT_DX) * span) >> 32
    dy = (_mix(key ^ _SALT_DY) * span) >> 32
    flip = _mix(key ^ _SALT_FLIP) >> 31
    return dx, dy, flip


def _check_span(span: int) -> None:
    if not 1 <= span <= MAX_SPAN:
        raise ValueError(f"span={span} is not in [1, {MAX_SPAN}]")


def draw(index: int, *, seed: int, epoch: int, span: int) -> tuple[int, int, int]:
    """One sample's (dx, dy, flip): offsets in [0, span), flip 0 or 1."""
    _check_span(span)
    dx, dy, flip = _words(_key(seed, epoch, int(index)), span)
    return dx, dy, flip


def draws(indices: torch.Tensor, *, seed: int, epoch: int, span: int) -> torch.Tensor:
    """``draw`` of every index at once: (len, 3) int64 of (dx, dy, flip), where ``indices``
    live (the GPU's for the GPU-resident path)."""
    _check_span(span)
    dx, dy, flip = _words(_key(seed, epoch, indices.to(torch.int64)), span)
    return torch.stack([dx, dy, flip], dim=1)
