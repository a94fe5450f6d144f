"""Plug-in models and datasets (``--model MODULE:FUNCTION --dataset MODULE:FUNCTION``) on the
trainer: a user's MLP and synthetic dataset, written to a temporary .py file, trained by 2
real Gloo ranks (forked: ``forked_cmd``), interrupted by a real signal mid-epoch and resumed;
and each
broken contract through the real ``hpc-ddp train``, each case a process of its own forked from
one that imported torch once (``cli_forkserver``). Nothing is mocked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_forkserver import ForkedCli
from trainer_helpers import (
    assert_resumed_like,
    forked_cmd,
    interrupt_at,
    read_result,
    reference_run,
    run,
    train_args,
)

PLUGIN = '''
import sys

import numpy as np
import torch
from torch import nn


def mlp(num_classes):
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, num_classes))


def wider(num_classes):
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, num_classes))


class Blobs(torch.utils.data.Dataset):
    """Four Gaussian blobs in 8 dimensions: learnable, and the same on every rank."""

    classes = ("north", "east", "south", "west")

    def __init__(self, split):
        g = torch.Generator().manual_seed({"train": 0, "test": 1}[split])
        n = 256 if split == "train" else 101
        self.y = torch.randint(0, 4, (n,), generator=g)
        centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(42)) * 3
        self.x = centers[self.y] + torch.randn(n, 8, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def blobs(split):
    return Blobs(split)


# Broken plug-ins, one broken promise each.
not_a_function = 3


def returns_a_list(num_classes):
    return [nn.Linear(8, num_classes)]


class NoClasses(Blobs):
    classes = None


def no_classes(split):
    return NoClasses(split)


class StrLabels(Blobs):
    def __getitem__(self, i):
        return self.x[i], "north"


def str_labels(split):
    return StrLabels(split)


class ListInputs(Blobs):
    def __getitem__(self, i):
        return self.x[i].tolist(), int(self.y[i])


def list_inputs(split):
    return ListInputs(split)


def not_a_dataset(split):
    return 42


class WithSpare(nn.Module):
    """A parameter the forward never uses: no rank has a gradient for it."""

    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.spare = nn.Linear(8, 8)

    def forward(self, x):
        return self.body(x)


def with_spare(num_classes):
    return WithSpare(num_classes)


def exits(num_classes):
    sys.exit(0)  # in the model function


class ExitsInForward(torch.nn.Linear):
    def forward(self, x):
        sys.exit(0)  # in the forward


def exits_in_forward(num_classes):
    return ExitsInForward(16, num_classes)


def exits_in_dataset(split):
    raise SystemExit(0)


class HugeLen(Blobs):
    def __len__(self):
        return 10**20


def huge_len(split):
    return HugeLen(split)


class NegativeLen(Blobs):
    def __len__(self):
        return -1


def negative_len(split):
    return NegativeLen(split)


class ManyClasses(Blobs):
    classes = range(10**12)


def many_classes(split):
    return ManyClasses(split)


class EvenMoreClasses(Blobs):
    classes = range(10**20)  # len() of it raises OverflowError


def even_more_classes(split):
    return EvenMoreClasses(split)


class FloatTensorLabels(Blobs):
    def __getitem__(self, i):
        return self.x[i], self.y[i].float()


def float_tensor_labels(split):
    return FloatTensorLabels(split)


class Corrupt(Blobs):
    def __getitem__(self, i):
        if i == 37:
            raise ValueError(f"corrupt record {i}")  # the user's own error
        return super().__getitem__(i)


def corrupt(split):
    return Corrupt(split)


class Quits(Blobs):
    def __getitem__(self, i):
        if i == 37:
            sys.exit(0)  # in an item
        return super().__getitem__(i)


def quits(split):
    return Quits(split)


class NumpyLabels(Blobs):
    def __getitem__(self, i):
        return self.x[i], np.int64(self.y[i])


def tensors(split):
    """Blobs' samples as a plain TensorDataset (0-d LongTensor labels) for training, and with
    numpy integer labels for testing."""
    if split == "test":
        return NumpyLabels(split)
    blobs = Blobs(split)
    data = torch.utils.data.TensorDataset(blobs.x, blobs.y)
    data.classes = Blobs.classes
    return data
'''


def line_of(text: str, source: str = PLUGIN) -> int:
    """The line number of ``text`` in ``source`` (a plug-in's error names where it raised)."""
    return next(n for n, line in enumerate(source.splitlines(), 1) if text in line)


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    path = tmp_path / "my_plugin.py"
    path.write_text(PLUGIN)
    (tmp_path / "quits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    return path


def plugin_settings(plugin: Path) -> dict[str, object]:
    """trainer_helpers.SMALL's run on the plug-ins (--data-dir is never read)."""
    return {"model": f"{plugin}:mlp", "dataset": f"{plugin}:blobs", "synthetic": False,
            "epochs": 3, "lr": 0.01}  # fmt: skip


def plugin_args(run_dir: Path, plugin: Path, **overrides: object) -> list[str]:
    return train_args(
        run_dir, run_dir.parent / "no-data", **{**plugin_settings(plugin), **overrides}
    )


@pytest.mark.slow
def test_plugin_resumed_after_a_signal_ends_bit_identical_and_learns(
    tmp_path: Path, plugin: Path, train_cli: ForkedCli
) -> None:
    ref_dir = reference_run(
        tmp_path / "ref", tmp_path / "no-data", timeout=300, **plugin_settings(plugin)
    )
    reference = read_result(ref_dir)
    assert reference["test_accuracy"] >= 0.9, reference  # 4 classes: chance is 0.25

    run_dir = tmp_path / "run"
    args = plugin_args(run_dir, plugin)
    # 256 samples / (2 ranks x 16) = 8 steps per epoch: step 5 is mid-epoch.
    rc, log = interrupt_at(
        forked_cmd(2, [*args, "--debug-hold-at-step", "5"]), run_dir, tmp_path / "1.log"
    )
    assert rc == 75, log
    assert "preempted (SIGUSR1): checkpointed at step 5" in log, log

    # The run's identity includes the plug-ins: another model is refused, nothing written.
    other = run(forked_cmd(2, plugin_args(run_dir, plugin, model=f"{plugin}:wider")))
    assert other.returncode != 0 and f"{plugin}:mlp' -> '{plugin}:wider'" in other.stderr

    final = run(forked_cmd(2, args), timeout=300)
    assert final.returncode == 0, final.stderr
    assert "resumed from" in final.stdout and "step 5" in final.stdout
    result = assert_resumed_like(run_dir, ref_dir, interruptions=1, steps=24)
    assert result["test_accuracy"] == reference["test_accuracy"]

    # Re-run, finished: answered from result.json, comparing the plug-in names unimported.
    again = train_cli.run(["train", *args])
    assert again.returncode == 0 and "already finished" in again.stdout, again.stderr


BAD = [
    # (model, dataset, what the error names)
    ("{p}:mlp", "no_such_module_xyz:blobs", "cannot import no_such_module_xyz"),
    ("{d}/missing.py:mlp", "{p}:blobs", "cannot import"),
    ("{p}:nothing_here", "{p}:blobs", "has no 'nothing_here'"),
    ("{p}:not_a_function", "{p}:blobs", "not_a_function is a int, not callable"),
    ("{p}:returns_a_list", "{p}:blobs", "returned a list, not a torch.nn.Module"),
    ("{p}:mlp", "{p}:not_a_dataset", "returned a int, not a map-style dataset"),
    ("{p}:mlp", "{p}:no_classes", "has no `classes` attribute"),
    ("{p}:mlp", "{p}:str_labels", "label is a str, not an int"),
    ("{p}:mlp", "{p}:list_inputs", "input is a list, not a tensor"),
    ("{p}:mlp", "my plugin:x;rm", "is not a registered dataset nor MODULE:FUNCTION"),
    # SystemExit from the plug-in's code: a failure naming it, never exit 0 having trained nothing.
    ("{p}:exits", "{p}:blobs", "exits(4) raised SystemExit(0) (at {p}, line {line}, in exits)"),
    ("{p}:mlp", "{p}:exits_in_dataset", "exits_in_dataset('train') raised SystemExit(0) (at {p}"),
    ("{p}:exits_in_forward", "{p}:blobs",
     "training raised SystemExit(0) (at {p}, line {forward}, in forward)"),
    ("{d}/quits_on_import.py:mlp", "{p}:blobs",
     "cannot import {d}/quits_on_import.py (SystemExit(0) (at {d}/quits_on_import.py, line 2"),
    # Sizes out of range: named, with the range allowed (len() itself raised a traceback).
    ("{p}:mlp", "{p}:huge_len",
     'split "train": __len__ returned 100000000000000000000: a split may have 1 to 2147483648 '
     "samples"),
    ("{p}:mlp", "{p}:negative_len", "__len__ returned -1: a split may have 1 to 2147483648"),
    ("{p}:mlp", "{p}:many_classes",
     "len(classes) is 1000000000000: a split may have 1 to 1048576 classes"),
    ("{p}:mlp", "{p}:even_more_classes",
     "len(classes) is more than 9223372036854775807: a split may have 1 to 1048576 classes"),
    ("{p}:mlp", "{p}:float_tensor_labels",
     "label is a torch.float32 tensor of shape (), not an int, a numpy integer or a 0-d integer"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "dataset", "expected"), BAD)
def test_a_bad_plugin_is_refused_naming_the_contract(
    tmp_path: Path, plugin: Path, train_cli: ForkedCli, model: str, dataset: str, expected: str
) -> None:
    names = {"p": str(plugin), "d": str(tmp_path), "line": line_of("in the model function")}
    names["forward"] = line_of("in the forward")
    run_dir = tmp_path / "run"
    args = [*plugin_args(run_dir, plugin), "--epochs", "1"]
    args += ["--model", model.format(**names), "--dataset", dataset.format(**names)]
    done = train_cli.run(["train", *args])
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert expected.format(**names) in done.stderr, done.stderr
    assert "plug-in is" in done.stderr or "MODULE:FUNCTION" in done.stderr  # the contract
    assert "Traceback" not in done.stderr, done.stderr
    assert not (run_dir / "result.json").exists()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(
    ("dataset", "raised", "at"),
    [("corrupt", "ValueError: corrupt record 37", "the user's own error"),
     ("quits", "SystemExit(0)", "in an item")],
)  # fmt: skip
def test_an_item_that_raises_is_one_error_naming_the_plugin_and_the_item(
    tmp_path: Path, plugin: Path, train_cli: ForkedCli, dataset: str, raised: str, at: str,
    workers: int,
) -> None:  # fmt: skip
    """Item 37 raises (in a DataLoader worker with --num-workers 1): one error naming the
    plug-in, the item, the user's own message and the line that raised it; no traceback, the
    worker's included, and a SystemExit there is a failure, not an exit 0 or a dead worker."""
    run_dir = tmp_path / "run"
    args = plugin_args(run_dir, plugin, dataset=f"{plugin}:{dataset}", epochs=1)
    done = train_cli.run(["train", *args, "--num-workers", str(workers)])
    assert done.returncode == 2, (done.stdout, done.stderr)
    expected = (
        f'dataset plug-in {plugin}:{dataset}: item 37 of split "train" raised {raised} '
        f"(at {plugin}, line {line_of(at)}, in __getitem__)"
    )
    assert expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "DataLoader worker" not in done.stderr
    assert done.stderr.count("error:") == 1, done.stderr
    assert not (run_dir / "result.json").exists()


def test_a_tensor_dataset_trains_as_the_same_samples_with_int_labels(
    tmp_path: Path, plugin: Path, train_cli: ForkedCli
) -> None:
    """A plain TensorDataset(x, y), y a LongTensor (0-d tensor labels), for training and numpy
    integer labels for testing: trained end to end, bit for bit as Blobs' int labels."""
    done = {}
    for dataset in ("blobs", "tensors"):
        args = plugin_args(tmp_path / dataset, plugin, dataset=f"{plugin}:{dataset}", epochs=2)
        done[dataset] = train_cli.run(["train", *args])
        assert done[dataset].returncode == 0, done[dataset].stderr
    ints, tensors = read_result(tmp_path / "blobs"), read_result(tmp_path / "tensors")
    assert tensors["status"] == "finished" and tensors["test_accuracy"] >= 0.9, tensors
    assert tensors["params_sha256"] == ints["params_sha256"]
    assert tensors["test_accuracy"] == ints["test_accuracy"]


def test_a_parameter_without_gradient_fails_the_job_naming_it(tmp_path: Path, plugin: Path) -> None:
    """Two Gloo ranks average every trainable gradient (tensor_average.py); one that backward
    never produced fails the step at once, saying which and what to do, and nobody hangs."""
    run_dir = tmp_path / "run"
    args = plugin_args(run_dir, plugin, model=f"{plugin}:with_spare", epochs=1)
    done = run(forked_cmd(2, args), timeout=120)
    assert done.returncode == 2, done.stderr  # bad input, not a crash
    assert "parameters spare.weight, spare.bias got no gradient" in done.stderr, done.stderr
    assert "requires_grad=False" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (run_dir / "result.json").exists()


def test_a_dotted_module_imports_from_the_working_directory(
    tmp_path: Path, plugin: Path, train_cli: ForkedCli
) -> None:
    """MODULE as a dotted name: found from the directory the command runs in."""
    run_dir = tmp_path / "run"
    args = plugin_args(run_dir, plugin, model="my_plugin:mlp", dataset="my_plugin:blobs")
    done = train_cli.run(["train", *args, "--epochs", "1"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert read_result(run_dir)["status"] == "finished"


def test_commands_that_do_not_train_never_import_the_plugin(tmp_path: Path) -> None:
    """A config naming plug-ins is validated without importing them (nor torch)."""
    marker = tmp_path / "imported"
    (tmp_path / "loud.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef f(n): pass\n")
    code = (
        "import sys\nfrom hpc_ddp.train import TrainConfig\n"
        f"TrainConfig(model={str(tmp_path / 'loud.py') + ':f'!r}, dataset='loud:f')\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    assert not marker.exists()
