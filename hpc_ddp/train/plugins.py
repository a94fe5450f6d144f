"""A user's model and dataset (``--model MODULE:FUNCTION --dataset MODULE:FUNCTION``), imported
where training happens and held to their contract (plugin_spec.CONTRACTS):

- model: ``FUNCTION(num_classes: int)`` returns a ``torch.nn.Module``;
- dataset: ``FUNCTION(split)``, split ``"train"`` or ``"test"``, returns a map-style dataset
  (``len`` and ``[i]``) of ``(input tensor, label)`` pairs with a ``classes`` sequence, whose
  length is the number of classes; a label is an int, a numpy integer or a 0-d integer tensor
  (a ``TensorDataset(x, y)`` with ``y`` a LongTensor, given a ``classes`` attribute, is one).

A plug-in dataset takes the generic loader path (loader_data.py): none of the CIFAR demo's
transforms (crop, flip, normalization) touch it. Each broken promise is a ConfigError (exit 2)
naming the plug-in and the contract, and so is whatever the plug-in's own code raises where
this module calls it (``_call``), with the exception's message and where it was raised.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import numbers
import operator
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

import hpc_ddp
from hpc_ddp import Comm, ShardPlan
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train.data_source import EvalData, TrainData
from hpc_ddp.train.loader_data import FailedItem, LoaderEvalData, LoaderTrainData
from hpc_ddp.train.loader_settings import LoaderSettings, choose, reads_from_disk
from hpc_ddp.train.plugin_spec import CONTRACTS, PluginSpec

if TYPE_CHECKING:  # annotations only: config -> registry -> plugins must not loop back
    from hpc_ddp import DistContext
    from hpc_ddp.train.config import TrainConfig

log = get_logger("data")

SPLITS = ("train", "test")
# A split's samples: the sampler permutes a split's indices every epoch, as 8-byte integers on
# every rank (16 GiB at this bound).
MAX_SAMPLES = 1 << 31
# Classes: the model's output layer has a row of weights per class, and the loss a term.
MAX_CLASSES = 1 << 20
# Frames that are not the plug-in's: where its exception was raised is the innermost other one.
_OURS = tuple(str(Path(m.__file__).parent) + os.sep for m in (hpc_ddp, importlib))


def _error(kind: str, spec: PluginSpec, problem: str) -> ConfigError:
    return ConfigError(
        f"{kind} plug-in {spec}: {problem}", hint=f"a {kind} plug-in is {CONTRACTS[kind]}"
    )


def _raised(err: BaseException) -> str:
    """What the plug-in raised and where: ``ValueError: bad row (at /a/p.py, line 9, in f)``."""
    frames = [
        frame
        for frame in traceback.extract_tb(err.__traceback__)
        if not frame.filename.startswith(("<", *_OURS))
    ]
    where = ""
    if frames:
        frame = frames[-1]
        where = f" (at {frame.filename}, line {frame.lineno}, in {frame.name})"
    if isinstance(err, SystemExit):
        return (
            f"SystemExit({err.code!r}){where}: a plug-in returns or raises an exception, "
            "it never ends the process"
        )
    return f"{type(err).__name__}: {err}{where}"


def exited_in_training(model: str, err: SystemExit) -> ConfigError:
    """The error for a SystemExit out of a training run: only the model's own code (its forward
    or backward) runs there besides the trainer's, which never exits that way, and the exit
    would otherwise end the process with its code (0: a run that stopped, reported a success)."""
    return ConfigError(
        f"model {model}: training raised {_raised(err)}",
        hint=f"a model plug-in is {CONTRACTS['model']}",
    )


def _call(kind: str, spec: PluginSpec, doing: str, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, where the plug-in's code runs. What it raises becomes a ConfigError
    naming the plug-in, ``doing`` and the exception; SystemExit too, which would otherwise end
    the process with its code (0: a run that trained nothing, reported as a success).
    KeyboardInterrupt passes: Ctrl-C stops the run as anywhere else."""
    try:
        return function(*args)
    except (Exception, SystemExit) as err:
        raise _error(kind, spec, f"{doing} raised {_raised(err)}") from err


def _import(kind: str, spec: PluginSpec) -> ModuleType:
    try:
        if not spec.is_path:
            # The working directory, as ``python -m`` has it, whichever way the trainer started.
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            return importlib.import_module(spec.module)
        path = Path(spec.module).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        # One module per file, under a name of its own, so that a DataLoader worker or pickle
        # finds it again in sys.modules.
        name = "hpc_ddp_plugin_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
        if name in sys.modules:
            return sys.modules[name]
        found = importlib.util.spec_from_file_location(name, path)
        if found is None or found.loader is None:
            raise ImportError(f"{path} is not a Python module")
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        try:
            found.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    except (Exception, SystemExit) as err:  # SystemExit: _call says why
        raise _error(kind, spec, f"cannot import {spec.module} ({_raised(err)})") from err


def load_function(kind: str, spec: PluginSpec) -> Callable[..., Any]:
    """The plug-in's FUNCTION, imported; ConfigError if it is not importable or not callable."""
    module = _import(kind, spec)
    if not hasattr(module, spec.function):
        raise _error(kind, spec, f"{spec.module} has no {spec.function!r}")
    function = getattr(module, spec.function)
    if not callable(function):
        raise _error(kind, spec, f"{spec.function} is a {type(function).__name__}, not callable")
    return function  # type: ignore[no-any-return]


def builder(kind: str, spec: PluginSpec) -> Callable[..., Any]:
    """The registry's builder for a plug-in (registry.resolve)."""
    return _model_builder(spec) if kind == "model" else _dataset_loader(spec)


def _model_builder(spec: PluginSpec) -> Callable[[int], torch.nn.Module]:
    function = load_function("model", spec)

    def build(num_classes: int) -> torch.nn.Module:
        net = _call("model", spec, f"{spec.function}({num_classes})", function, num_classes)
        if not isinstance(net, torch.nn.Module):
            raise _error("model", spec, f"returned a {type(net).__name__}, not a torch.nn.Module")
        return net

    return build


def _label(y: Any) -> int | None:
    """The class index of a label: an int, a numpy integer or a 0-d integer tensor."""
    if isinstance(y, torch.Tensor):
        integer = not (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool)
        return int(y) if integer and y.dim() == 0 else None
    if isinstance(y, numbers.Integral) and not isinstance(y, bool):
        return int(y)
    return None


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


class CheckedDataset(Dataset[tuple[torch.Tensor, int] | FailedItem]):
    """A plug-in split whose items are checked as they are read: (tensor, int in range).

    ``item`` raises; ``[i]``, what the DataLoader reads (in its worker processes too), gives a
    ``FailedItem`` instead, which the loader raises where the batches are used (loader_data)."""

    def __init__(
        self, spec: PluginSpec, split: str, data: Any, size: int, num_classes: int
    ) -> None:
        self.spec, self.split, self.data = spec, split, data
        self.size, self.num_classes = size, num_classes

    @property
    def from_disk(self) -> bool:
        """The plug-in's dataset decodes files (``from_disk``): loader_settings' workers."""
        return reads_from_disk(self.data)

    @property
    def epoch_indices(self) -> bool:
        """The plug-in's dataset takes loader_data.EpochIndex indices (its own augmentation)."""
        return bool(getattr(self.data, "epoch_indices", False))

    def __len__(self) -> int:
        return self.size  # checked once: the plug-in's __len__ may not answer the same again

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | FailedItem:
        return FailedItem.or_item(self.item, index)

    def item(self, index: int) -> tuple[torch.Tensor, int]:
        where = f'item {index} of split "{self.split}"'
        item = _call("dataset", self.spec, where, operator.getitem, self.data, index)
        if not isinstance(item, tuple | list) or len(item) != 2:
            shown = type(item).__name__
            raise _error("dataset", self.spec, f"{where} is a {shown}, not an (input, label) pair")
        x, y = item
        if not isinstance(x, torch.Tensor):
            raise _error("dataset", self.spec, f"{where}: input is a {_shown(x)}, not a tensor")
        label = _label(y)
        if label is None:
            raise _error(
                "dataset",
                self.spec,
                f"{where}: label is a {_shown(y)}, not an int, a numpy integer or a 0-d "
                "integer tensor",
            )
        if not 0 <= label < self.num_classes:
            raise _error(
                "dataset",
                self.spec,
                f"{where}: label {label} is outside 0..{self.num_classes - 1} "
                f"(len(classes) is {self.num_classes})",
            )
        return x, label


def _count(spec: PluginSpec, split: str, of: str, value: Any, limit: int, unit: str) -> int:
    """``len(value)`` checked against ``1..limit``, naming ``of`` (what was measured).

    The length as ``__len__`` returned it: ``len()`` itself refuses one below 0 or past
    ``sys.maxsize`` with an error that names neither the plug-in nor the attribute."""
    where = f'split "{split}": {of}'  # "__len__ returned", "len(classes) is"
    try:
        raw: Any = type(value).__len__(value)
    except OverflowError:  # a length of C code's own (range), past sys.maxsize
        raw = None
    except (Exception, SystemExit) as err:
        raise _error("dataset", spec, f"{where} raised {_raised(err)}") from err
    allowed = f"a split may have 1 to {limit} {unit}"
    if raw is None:
        raise _error("dataset", spec, f"{where} more than {sys.maxsize}: {allowed}")
    try:
        n = operator.index(raw)
    except TypeError:
        raise _error("dataset", spec, f"{where} a {_shown(raw)}, not an int") from None
    if not 1 <= n <= limit:
        raise _error("dataset", spec, f"{where} {n}: {allowed}")
    return n


def _checked_split(spec: PluginSpec, split: str, data: Any) -> CheckedDataset:
    if not (hasattr(type(data), "__len__") and hasattr(type(data), "__getitem__")):
        shown = type(data).__name__
        raise _error(
            "dataset", spec, f'split "{split}" returned a {shown}, not a map-style dataset'
        )
    reading = f'split "{split}": reading `classes`'
    classes = _call("dataset", spec, reading, getattr, data, "classes", None)
    if classes is None:
        raise _error("dataset", spec, f'split "{split}" has no `classes` attribute')
    if not isinstance(classes, Sequence) or isinstance(classes, str):
        raise _error(
            "dataset",
            spec,
            f'split "{split}": `classes` is a {type(classes).__name__}, not a sequence',
        )
    num_classes = _count(spec, split, "len(classes) is", classes, MAX_CLASSES, "classes")
    size = _count(spec, split, "__len__ returned", data, MAX_SAMPLES, "samples")
    checked = CheckedDataset(spec, split, data, size, num_classes)
    checked.item(0)  # the first item now, before any process group waits on a broken dataset
    return checked


@dataclass
class PluginSplits:
    """The trainer's data of a plug-in dataset (``data_source.Splits``): the loader path."""

    train_set: CheckedDataset
    test_set: CheckedDataset
    num_workers: int
    settings: LoaderSettings | None = None  # a dataset read from disk: loader_settings.choose

    @property
    def n(self) -> int:
        return len(self.train_set)

    @property
    def num_classes(self) -> int:
        return self.train_set.num_classes

    def make(
        self, plan: ShardPlan, *, rank: int, world_size: int, device: torch.device
    ) -> tuple[TrainData, EvalData]:
        train = LoaderTrainData(
            plan, self.train_set, rank, device, self.num_workers, settings=self.settings
        )
        test = LoaderEvalData(self.test_set, rank, world_size, device, settings=self.settings)
        return train, test

    def example(self) -> torch.Tensor:
        return torch.as_tensor(self.train_set.item(0)[0]).unsqueeze(0)


def _read(spec: PluginSpec, cfg: TrainConfig) -> PluginSplits:
    if cfg.data_path == "gpu":
        raise ConfigError(
            f"--data-path gpu holds the CIFAR demo's arrays on the GPU; the plug-in dataset "
            f"{spec} is read through a DataLoader",
            hint="use --data-path auto (or torchvision) with a plug-in dataset",
        )
    function = load_function("dataset", spec)
    train, test = (
        _checked_split(spec, s, _call("dataset", spec, f"{spec.function}({s!r})", function, s))
        for s in SPLITS
    )
    if train.num_classes != test.num_classes:
        raise _error(
            "dataset",
            spec,
            f'splits "train" and "test" have {train.num_classes} and {test.num_classes} classes',
        )
    return PluginSplits(train, test, cfg.num_workers or 0)


def _dataset_loader(spec: PluginSpec) -> Callable[[TrainConfig, DistContext, Comm], PluginSplits]:
    def load(cfg: TrainConfig, ctx: DistContext, comm: Comm) -> PluginSplits:
        """Every rank reads both splits; a rank whose read fails fails them all (Comm.check)."""
        error: BaseException | None = None
        splits: PluginSplits | None = None
        try:
            splits = _read(spec, cfg)
        except Exception as err:
            error = err
        comm.check(error, f"reading the dataset plug-in {spec}")
        assert splits is not None  # check raised otherwise
        if splits.train_set.from_disk:
            splits.settings = choose(
                cfg.num_workers,
                from_disk=True,
                cuda=ctx.devices[0].type == "cuda",
                source=ctx.env.source,
                local_world_size=ctx.env.local_world_size,
            )
            log.info(splits.settings.describe())
        return splits

    return load
