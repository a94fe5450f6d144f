"""The synthetic CIFAR-format data (hpc_ddp.train.cifar.synthetic): its two variants, where each
lives, its marker, that torchvision reads both, and that the trainer and the benchmark agree on
them.

The easy variant must not change at all (many tests rely on it being learnt in an epoch): its
files are pinned by hash, computed before the hard variant existed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from hostile_files import lock_held_elsewhere

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.train import config
from hpc_ddp.train.cifar import synthetic
from hpc_ddp.train.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent
TRAIN, TEST = 200, 50
# sha256 of the easy files for TRAIN/TEST, seed 1234 (computed before variants existed).
EASY_SHA256 = {
    ("cifar100", "train"): "b549615c3218066bbabf18dc903d19ec29c5991623208280163a952bed5ddf4a",
    ("cifar100", "test"): "6f7e1eac73a3cc1df257d83e162c2f8afe49ea077608a36c7993569a3a9056f5",
    ("cifar100", synthetic.MARKER): (
        "e960588dea91629e4b16cf72eae129c2f63616490762b8980259ba9923d8118e"
    ),
    ("cifar10", "data_batch_1"): "5ba4283c297ab220a7a7063733621c8b88fba2cb7c52f5dd4f9ba35f5d6be9be",
    ("cifar10", "test_batch"): "717ed52b3f700610919d786d461af2075d663b308439c61510746ae24ee05fc6",
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(root: Path, dataset: str = "cifar100", **kw) -> Path:
    return synthetic.write_synthetic(root, dataset, train_size=TRAIN, test_size=TEST, **kw)


def test_easy_is_unchanged_and_the_default(tmp_path: Path) -> None:
    for dataset in ("cifar100", "cifar10"):
        default = _write(tmp_path / "default", dataset)
        explicit = _write(tmp_path / "explicit", dataset, variant="easy")
        for (name, filename), digest in EASY_SHA256.items():
            if name == dataset:
                assert _sha256(default / filename) == digest, filename
                assert _sha256(explicit / filename) == digest, filename
    marker = json.loads((tmp_path / "default" / "cifar-100-python" / synthetic.MARKER).read_text())
    assert "variant" not in marker and marker["version"] == synthetic.GENERATOR_VERSION


def test_roots_per_variant(tmp_path: Path) -> None:
    easy = synthetic.synthetic_root(tmp_path, "cifar100", TRAIN, TEST)
    assert easy == tmp_path / f"synthetic-cifar100-{TRAIN}-{TEST}"  # where it always was
    assert synthetic.synthetic_root(tmp_path, "cifar100", TRAIN, TEST, "easy") == easy
    hard = synthetic.synthetic_root(tmp_path, "cifar100", TRAIN, TEST, "hard")
    assert hard == tmp_path / f"synthetic-cifar100-{TRAIN}-{TEST}-hard"
    with pytest.raises(ValueError, match="unknown synthetic variant 'medium'"):
        synthetic.synthetic_root(tmp_path, "cifar100", TRAIN, TEST, "medium")
    with pytest.raises(ValueError, match="unknown synthetic variant"):
        _write(tmp_path, variant="medium")


def test_marker_tells_the_variants_apart(tmp_path: Path) -> None:
    def current(variant: str, seed: int = 1234) -> bool:
        return synthetic.is_current(tmp_path, "cifar100", TRAIN, TEST, seed, variant=variant)

    assert not current("easy") and not current("hard")  # nothing written yet
    folder = _write(tmp_path)
    assert current("easy") and not current("hard")
    easy_train = (folder / "train").read_bytes()
    _write(tmp_path, variant="hard")  # the same root: replaces the easy files
    assert current("hard") and not current("easy") and not current("hard", seed=1)
    assert (folder / "train").read_bytes() != easy_train
    marker = json.loads((folder / synthetic.MARKER).read_text())
    assert marker["variant"] == "hard" and marker["version"] == synthetic.HARD_VERSION
    assert not synthetic.is_current(tmp_path, "cifar100", TRAIN + 1, TEST, 1234, variant="hard")


def test_hard_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    files = ("train", "test", "meta", synthetic.MARKER)
    a = _write(tmp_path / "a", variant="hard")
    b = _write(tmp_path / "b", variant="hard")
    c = _write(tmp_path / "c", variant="hard", seed=99)
    assert [_sha256(a / f) for f in files] == [_sha256(b / f) for f in files]
    assert _sha256(a / "train") != _sha256(c / "train")
    assert _sha256(a / "test") != _sha256(c / "test")


@pytest.mark.parametrize("dataset", ["cifar100", "cifar10"])
def test_torchvision_reads_the_hard_files(tmp_path: Path, dataset: str) -> None:
    from hpc_ddp.train.cifar.data import dataset_class  # torchvision's class, MD5 checks off

    _write(tmp_path, dataset, variant="hard")
    cls = dataset_class(dataset, is_synthetic=True)
    train, test = cls(str(tmp_path), train=True), cls(str(tmp_path), train=False)
    assert (len(train), len(test)) == (TRAIN, TEST)
    assert train.data.shape == (TRAIN, 32, 32, 3) and train.data.dtype == np.uint8
    assert len(train.classes) == synthetic.NUM_CLASSES[dataset]
    assert set(train.targets) <= set(range(synthetic.NUM_CLASSES[dataset]))
    image, label = train[0]
    assert image.size == (32, 32) and label == train.targets[0]
    assert train.data.std() > 30  # images, not a constant


def _nearest_centroid_accuracy(variant: str) -> float:
    """Train/test accuracy of a per-class mean on raw pixels: ~chance for noise, ~1 if trivial."""
    n_train, n_test, classes = 3000, 1000, 100
    rng = np.random.default_rng(1235)
    if variant == "easy":
        templates = synthetic._templates(classes, 1234)
        x, y = synthetic._samples(templates, n_train, rng, 48.0)
        xt, yt = synthetic._samples(templates, n_test, rng, 48.0)
    else:
        spec = synthetic._hard_classes(classes, 1234)
        x, y = synthetic._hard_samples(spec, n_train, rng)
        xt, yt = synthetic._hard_samples(spec, n_test, rng)
    x, xt, y = x.astype(np.float32), xt.astype(np.float32), np.array(y)
    means = np.stack([x[y == c].mean(0) for c in range(classes)])
    dist = -2 * xt @ means.T + (means**2).sum(1)[None]
    return float((dist.argmin(1) == np.array(yt)).mean())


def test_hard_is_learnable_but_not_trivial() -> None:
    """The cheap proxy; the real check (LeNet ~45 % after 10 epochs) is in the report."""
    assert _nearest_centroid_accuracy("easy") > 0.95
    assert 0.04 < _nearest_centroid_accuracy("hard") < 0.3  # chance: 0.01


def test_trainer_config_and_staging(tmp_path: Path) -> None:
    assert config.SYNTHETIC_VARIANTS == synthetic.VARIANTS
    assert TrainConfig().synthetic_variant == "easy"
    with pytest.raises(ConfigError, match="synthetic_variant='medium' is not valid"):
        TrainConfig(synthetic_variant="medium")
    assert "synthetic_variant" in config.IDENTITY_KEYS
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    cfg = config.from_args(parser.parse_args(["--synthetic-variant", "hard"]))
    assert cfg.synthetic_variant == "hard"

    from hpc_ddp.train.cifar import data

    sizes = {"synthetic_train_size": TRAIN, "synthetic_test_size": TEST}
    for variant in ("easy", "hard"):
        cfg = TrainConfig(
            data_dir=str(tmp_path),
            dataset="cifar100",
            synthetic=True,
            **sizes,
            synthetic_variant=variant,
        )
        root = data.stage(cfg)
        assert root == data.data_root(cfg)
        assert root == synthetic.synthetic_root(tmp_path, "cifar100", TRAIN, TEST, variant)
        assert synthetic.is_current(root, "cifar100", TRAIN, TEST, 1234, variant=variant)
    # Both copies stay side by side.
    assert synthetic.is_current(
        synthetic.synthetic_root(tmp_path, "cifar100", TRAIN, TEST), "cifar100", TRAIN, TEST, 1234
    )


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench", REPO / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["hard", "easy"])
def test_bench_reference_and_trainer_read_the_same_files(tmp_path: Path, variant: str) -> None:
    """bench.py hands the conventional script ``self.root`` and our trainer its flags: the
    trainer's own data_root of those flags must be that very directory, staged by bench."""
    from hpc_ddp.train.cifar import data

    bench = _bench_module()
    args = argparse.Namespace(
        out=str(tmp_path / "out"),
        work=str(tmp_path / "work"),
        budget_s=60.0,
        smoke=True,
        train_size=TRAIN,
        test_size=TEST,
        synthetic_variant=variant,
    )
    b = bench.Bench(args)
    b.stage()
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    flags = b.trainer_flags("lenet", 1, 64, tmp_path / "run")
    cfg = config.from_args(parser.parse_args(flags))
    assert cfg.synthetic_variant == variant
    assert data.data_root(cfg) == b.root
    assert b.root == synthetic.synthetic_root(
        tmp_path / "work" / "data", "cifar100", TRAIN, TEST, variant
    )
    assert synthetic.is_current(b.root, "cifar100", TRAIN, TEST, 1234, variant=variant)


def test_a_folder_of_the_users_is_never_replaced(tmp_path: Path) -> None:
    """Where the synthetic set goes, a folder without its marker (or a link) is the user's:
    staging refuses it, naming it, and leaves it and the data dir as they were."""
    from hpc_ddp.train.cifar import data

    cfg = TrainConfig(
        data_dir=str(tmp_path), dataset="cifar100", synthetic=True,
        synthetic_train_size=TRAIN, synthetic_test_size=TEST,
    )  # fmt: skip
    folder = data.data_root(cfg) / synthetic.FOLDERS["cifar100"]
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(HpcDdpError, match="not a synthetic dataset hpc-ddp wrote") as info:
        data.stage(cfg)
    assert "--data-dir" in (info.value.hint or "")
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temp dir left
    (folder / "notes.txt").unlink()
    folder.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder.symlink_to(elsewhere)
    with pytest.raises(HpcDdpError, match="refusing to replace it"):
        data.stage(cfg)
    assert folder.is_symlink() and elsewhere.is_dir()
    folder.unlink()
    assert synthetic.is_current(data.stage(cfg), "cifar100", TRAIN, TEST, 1234)  # then it writes


def test_a_staging_lock_held_for_ever_ends_in_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Another process holds the data dir's staging lock and never lets go (stopped, hung):
    staging says it waits, then fails naming the lock file, instead of waiting for ever. The
    holder is a real process holding the real lock; only the waits are shortened."""
    from hpc_ddp.train.cifar import data

    monkeypatch.setattr(data, "STAGING_NOTICE_S", 0.5)
    monkeypatch.setattr(data, "STAGING_WAIT_S", 2.0)
    lock_file = tmp_path / data.STAGING_LOCK
    cfg = TrainConfig(
        data_dir=str(tmp_path), dataset="cifar100", synthetic=True,
        synthetic_train_size=TRAIN, synthetic_test_size=TEST,
    )  # fmt: skip
    take = f"from filelock import FileLock\nlock = FileLock({str(lock_file)!r})\nlock.acquire()"
    with lock_held_elsewhere(take):
        started = time.monotonic()
        with pytest.raises(data.DataError, match="held by another process for 2 s") as info:
            data.stage(cfg)
        assert time.monotonic() - started < 30
        assert f"fuser -v {lock_file}" in (info.value.hint or "")
        assert f"waiting for {lock_file}" in capfd.readouterr().out  # the log says why it waits
    assert synthetic.is_current(data.stage(cfg), "cifar100", TRAIN, TEST, 1234)  # released
    assert (tmp_path / data.STAGING_HOLDER).read_text().startswith(f"pid {os.getpid()} on ")


def test_each_holder_of_the_staging_lock_gets_a_full_wait_and_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node after node may stage (or check) a large dataset on a shared dir: the wait is per
    holder. The lock changes hands (the holder's line changes) 1.5 s in, so a 2-s wait ends
    no sooner than 3.5 s in, naming the second holder."""
    from hpc_ddp.train.cifar import data

    monkeypatch.setattr(data, "STAGING_POLL_S", 0.2)
    monkeypatch.setattr(data, "STAGING_WAIT_S", 2.0)
    lock_file, holder = tmp_path / data.STAGING_LOCK, tmp_path / data.STAGING_HOLDER
    cfg = TrainConfig(data_dir=str(tmp_path), dataset="cifar100", synthetic=True)
    take = (
        f"import pathlib, threading\nfrom filelock import FileLock\n"
        f"lock = FileLock({str(lock_file)!r})\nlock.acquire()\nh = pathlib.Path({str(holder)!r})\n"
        "h.write_text('pid 1 on first')\n"
        "threading.Timer(1.5, lambda: h.write_text('pid 2 on second\\x1b[2J')).start()"
    )
    with lock_held_elsewhere(take):
        started = time.monotonic()
        with pytest.raises(data.DataError, match=r"held by pid 2 on second\[2J for 2 s"):
            data.stage(cfg)  # the terminal escape of the planted line is not printed
        assert time.monotonic() - started >= 3.0
