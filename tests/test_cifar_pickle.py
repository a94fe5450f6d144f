"""CIFAR's pickled batches from a data directory someone else can write: no code runs, nothing
blocks, the .npy cache is neither unpickled nor written through planted links.

Real parts only: batch files in CIFAR's exact on-disk format (``synthetic.write_synthetic``, and
the Python 2 form of the official files), a pickle whose loading runs ``touch`` through
os.system (the canary file must never appear), real FIFOs, a real ``hpc-ddp train`` process.
Reads that the old code could block on run in a child process with a deadline.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile_files import evil_pickle, make_fifo, python2_pickle, run_child
from trainer_helpers import run, single_cmd, train_args

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.train.cifar import synthetic
from hpc_ddp.train.cifar.data import load_datasets
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast import array_cache, gpu_data

TRAIN, TEST = 40, 10
FILES = {
    "cifar10": ["data_batch_1", "data_batch_5", "test_batch", "batches.meta"],
    "cifar100": ["train", "test", "meta"],
}


def staged(tmp_path: Path, dataset: str) -> Path:
    root = synthetic.synthetic_root(tmp_path, dataset, TRAIN, TEST)
    synthetic.write_synthetic(root, dataset, train_size=TRAIN, test_size=TEST)
    return root


def cfg_for(dataset: str, data_dir: Path) -> TrainConfig:
    return TrainConfig(
        dataset=dataset,
        data_dir=str(data_dir),
        synthetic=True,
        synthetic_train_size=TRAIN,
        synthetic_test_size=TEST,
    )


@pytest.mark.parametrize(("dataset", "name"), [(d, n) for d, names in FILES.items() for n in names])
def test_a_batch_that_would_run_code_is_refused_and_the_code_never_runs(
    tmp_path: Path, dataset: str, name: str
) -> None:
    """Both readers the trainer uses (the loader path's datasets, the GPU path's arrays)."""
    root = staged(tmp_path, dataset)
    target = root / synthetic.FOLDERS[dataset] / name
    canary = tmp_path / "code-ran"
    target.write_bytes(evil_pickle(canary))
    with pytest.raises(Exception) as err:  # its type: checked after the canary
        load_datasets(cfg_for(dataset, tmp_path), root)
    assert not canary.exists(), "unpickling a batch ran code from it"
    assert isinstance(err.value, HpcDdpError), err.value
    text = str(err.value)
    assert f"{target} is not a CIFAR batch" in text and "posix.system" in text, text
    assert "refused without running it" in text and err.value.hint
    if "meta" not in name:
        with pytest.raises(Exception) as err:
            gpu_data.load_cifar_arrays(root, dataset, train="test" not in name)
        assert not canary.exists(), "unpickling a batch ran code from it"
        assert isinstance(err.value, pickle.UnpicklingError) and "not a CIFAR batch" in str(
            err.value
        )


def test_hpc_ddp_train_refuses_a_planted_batch_without_running_it(tmp_path: Path) -> None:
    """The real CLI on a synthetic data dir whose marker says "current" and whose first batch is
    a code-running pickle: exit 2 naming the file, and the code never ran."""
    data_dir = tmp_path / "data"
    args = train_args(tmp_path / "run", data_dir)
    root = synthetic.synthetic_root(data_dir, "cifar10", 256, 101)  # train_args' sizes
    synthetic.write_synthetic(root, "cifar10", train_size=256, test_size=101)
    assert synthetic.is_current(root, "cifar10", 256, 101, seed=1234)
    canary = tmp_path / "code-ran"
    batch = root / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(evil_pickle(canary))
    done = run(single_cmd(args))
    assert not canary.exists(), "hpc-ddp train ran code from a data file"
    assert done.returncode == 2, done.stderr
    assert f"{batch} is not a CIFAR batch" in done.stderr and "HINT" in done.stderr


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dataset", list(FILES))
def test_real_cifar_format_files_load_exactly_as_pickle_loads_them(
    tmp_path: Path, dataset: str
) -> None:
    """The restricted reader returns what ``pickle.load(encoding="latin1")`` (torchvision's read)
    returns, for the files the synthetic writer makes and for the official files' Python 2 form
    (str as BINSTRING, ``numpy.core.multiarray._reconstruct``)."""
    from hpc_ddp.train.cifar import safe_pickle as cifar_pickle

    folder = staged(tmp_path, dataset) / synthetic.FOLDERS[dataset]
    for name in FILES[dataset]:
        with (folder / name).open("rb") as fh:
            theirs = pickle.load(fh, encoding="latin1")
        _same(cifar_pickle.load(folder / name), theirs)
        py2 = tmp_path / f"{name}.py2"
        py2.write_bytes(python2_pickle(theirs))
        assert b"numpy.core.multiarray\n_reconstruct" in py2.read_bytes() or "meta" in name
        with py2.open("rb") as fh:
            _same(cifar_pickle.load(py2), pickle.load(fh, encoding="latin1"))


def test_object_arrays_and_unexpected_encodings_are_refused(tmp_path: Path) -> None:
    from hpc_ddp.train.cifar import safe_pickle as cifar_pickle

    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps({"data": np.array([1, "x"], dtype=object)}, protocol=2))
    with pytest.raises(cifar_pickle.NotCifarFileError, match="array of Python objects"):
        cifar_pickle.load(path)
    many = {f"a{i}": np.zeros(1, np.uint8) for i in range(cifar_pickle.MAX_ARRAYS + 1)}
    path.write_bytes(pickle.dumps(many, protocol=2))
    with pytest.raises(cifar_pickle.NotCifarFileError, match="other objects than the arrays"):
        cifar_pickle.load(path)
    path.write_bytes(pickle.dumps([1, 2], protocol=2))
    with pytest.raises(cifar_pickle.NotCifarFileError, match="holds a list"):
        cifar_pickle.load(path)


# --------------------------------------------------------------------- blocking and the cache
READ = """
import json, sys
from hpc_ddp.train.fast import array_cache
cap_memory()
try:
    images, labels = array_cache.read_batch(__import__("pathlib").Path(sys.argv[1]), ("labels",))
    out = {"labels": labels.tolist(), "images_sum": int(images.sum())}
except BaseException as exc:
    out = {"error": type(exc).__name__, "message": str(exc)[:300]}
print(json.dumps(out))
"""


def write_batch(path: Path, value: int, labels: list[int]) -> None:
    pixels = np.full((len(labels), 3072), value, np.uint8)
    path.write_bytes(pickle.dumps({"data": pixels, "labels": labels}, protocol=2))


def test_a_fifo_in_place_of_a_batch_is_refused_at_once(tmp_path: Path) -> None:
    make_fifo(tmp_path / "data_batch_1")
    out = run_child(READ, str(tmp_path / "data_batch_1"), timeout=60)
    assert out["error"] == "NotRegularFileError" and "a FIFO, not a regular file" in out["message"]


def _cache_files(source: Path) -> tuple[Path, Path, Path]:
    return array_cache._paths(source)


def test_a_fifo_as_the_cache_stamp_is_ignored(tmp_path: Path) -> None:
    source = tmp_path / "data_batch_1"
    write_batch(source, 3, [1, 2])
    array_cache.read_batch(source, ("labels",))  # cached
    make_fifo(_cache_files(source)[2])
    out = run_child(READ, str(source), timeout=60)
    assert out == {"labels": [1, 2], "images_sum": 3 * 2 * 3072}, out


def _npy_header_claiming(shape: tuple[int, ...], dtype: str) -> bytes:
    import io

    from numpy.lib import format as npformat

    buf = io.BytesIO()
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    npformat.write_array_header_1_0(buf, header)
    return buf.getvalue()


@pytest.mark.parametrize("poison", ["huge header", "object array"])
def test_a_poisoned_cache_is_not_trusted_and_the_pickle_serves(tmp_path: Path, poison: str) -> None:
    """A .npy planted with the current stamp: one whose header claims 30 GB (the old reader
    allocated it: MemoryError), one that holds pickled objects (never unpickled)."""
    source = tmp_path / "data_batch_1"
    write_batch(source, 5, [7, 8, 9])
    array_cache.read_batch(source, ("labels",))
    images_npy = _cache_files(source)[0]
    if poison == "huge header":
        images_npy.write_bytes(_npy_header_claiming((10**7, 3072), "|u1") + b"\0" * 64)
    else:
        np.save(images_npy, np.array([1, "x"], dtype=object), allow_pickle=True)
    out = run_child(READ, str(source), timeout=60)
    assert out == {"labels": [7, 8, 9], "images_sum": 5 * 3 * 3072}, out


def test_the_cache_is_never_written_through_a_planted_symlink(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("not the toolkit's")
    data = tmp_path / "data"
    data.mkdir()
    source = data / "data_batch_1"
    write_batch(source, 1, [4])
    # A symlink under the temporary name this process will use for the images array ...
    cache = data / array_cache.CACHE_DIR
    cache.mkdir()
    images_npy = _cache_files(source)[0]
    (cache / f".{images_npy.name}.tmp-{os.getpid()}").symlink_to(victim)
    assert array_cache.read_batch(source, ("labels",))[1].tolist() == [4]
    assert victim.read_text() == "not the toolkit's"
    # ... and a symlinked cache directory: nothing is written where it points.
    (cache / f".{images_npy.name}.tmp-{os.getpid()}").unlink()
    for path in cache.iterdir():
        path.unlink()
    cache.rmdir()
    cache.symlink_to(elsewhere)
    assert array_cache.read_batch(source, ("labels",))[1].tolist() == [4]
    assert list(elsewhere.iterdir()) == []


STAGE = """
import json, sys
from hpc_ddp.train.cifar import data
from hpc_ddp.train.config import TrainConfig
cap_memory()
from hpc_ddp.errors import HpcDdpError
cfg = TrainConfig(**json.loads(sys.argv[1]))
try:
    print(json.dumps({"root": str(data.stage(cfg))}))
except HpcDdpError as err:
    print(json.dumps({"refused": err.message}))
"""


def test_a_fifo_as_the_synthetic_marker_does_not_hang_staging(tmp_path: Path) -> None:
    """Neither reading the marker nor deciding whether the folder may be replaced opens the
    FIFO: staging ends at once, refusing a folder whose marker is not the generator's file (it
    is no longer known to be the toolkit's alone), and leaves it as it was."""
    cfg = cfg_for("cifar10", tmp_path)
    root = staged(tmp_path, "cifar10")
    fifo = make_fifo(root / synthetic.FOLDERS["cifar10"] / synthetic.MARKER)
    settings = {k: getattr(cfg, k) for k in ("dataset", "data_dir", "synthetic")}
    settings |= {"synthetic_train_size": TRAIN, "synthetic_test_size": TEST}
    out = run_child(STAGE, json.dumps(settings), timeout=60)
    assert "is not a synthetic dataset hpc-ddp wrote" in out["refused"], out
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
