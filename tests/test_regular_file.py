"""Bounded reads of files someone else could place (hpc_ddp/regular_file.py): the whole file
when it is within the limit, a clear refusal when not, and the same answer whichever way the
size is learnt (from fstat before reading, or from reading a file that grew)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from hpc_ddp.regular_file import FileTooLargeError, open_regular, read_capped, read_small


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 70_000])
def test_a_file_within_the_limit_is_read_whole(tmp_path: Path, size: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    assert read_small(path, 70_000) == path.read_bytes()


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 101)
    with pytest.raises(FileTooLargeError, match="101 bytes, larger than the 100") as err:
        read_small(path, 100)
    assert err.value.errno == errno.EFBIG


def test_a_file_that_grew_after_its_size_was_taken_is_read_on_within_the_limit(
    tmp_path: Path,
) -> None:
    """``first``: the bytes read before the file was found longer than its fstat size."""
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    with open_regular(path) as f:
        first = f.read(4)
        assert read_capped(f, 10, path, first) == b"0123456789"
    with open_regular(path) as f:
        first = f.read(4)
        with pytest.raises(FileTooLargeError, match="larger than the 9 bytes"):
            read_capped(f, 9, path, first)
