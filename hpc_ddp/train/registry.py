"""The trainer's models and datasets, by name: the one place the trainer looks them up.

An entry is a name and a ``module:attribute`` target, imported only when a run builds it, so
this registry (and the config validation that consults it) stays torch-free. The CIFAR demo
declares its entries in ``hpc_ddp/train/cifar/entries.py``. A name of the form
``MODULE:FUNCTION`` is a user's plug-in (plugin_spec.py: its syntax, checked without
importing it; plugins.py: the contract, checked when a run builds it).

- A model target is ``f(num_classes: int) -> torch.nn.Module``.
- A dataset target is ``f(cfg, ctx, comm) -> hpc_ddp.train.data_source.Splits``: it stages
  and reads the data on every rank (``comm.check`` makes failures collective).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Literal

from hpc_ddp.errors import ConfigError
from hpc_ddp.train import plugin_spec

Kind = Literal["model", "dataset"]
_ENTRIES: dict[Kind, dict[str, str]] = {"model": {}, "dataset": {}}
_builtins_loaded = False


def register(kind: Kind, name: str, target: str) -> None:
    """Make ``name`` a ``--model``/``--dataset`` choice built by ``target`` (``module:attr``)."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"registry target {target!r} is not 'module:attribute'")
    _ENTRIES[kind][name] = target


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        from hpc_ddp.train.cifar import entries  # lenet, resnet18, cifar10, cifar100

        for name, target in entries.MODELS.items():
            register("model", name, target)
        for name, target in entries.DATASETS.items():
            register("dataset", name, target)


def names(kind: Kind) -> tuple[str, ...]:
    _load_builtins()
    return tuple(_ENTRIES[kind])


def is_plugin(name: str) -> bool:
    return name not in names("model") + names("dataset") and plugin_spec.looks_like_plugin(name)


def check(kind: Kind, name: str) -> None:
    """ConfigError unless ``name`` is registered or a well-formed ``MODULE:FUNCTION`` (config
    validation: nothing is imported)."""
    if is_plugin(name):
        plugin_spec.parse(kind, name)
    elif name not in names(kind):
        raise ConfigError(
            f"{kind}={name!r} is not valid",
            hint=f"use one of: {', '.join(names(kind))}, or MODULE:FUNCTION for your own "
            f"({plugin_spec.CONTRACTS[kind]})",
        )


def resolve(kind: Kind, name: str) -> Callable[..., Any]:
    """The builder of an entry: a model's ``f(num_classes)``, a dataset's ``f(cfg, ctx, comm)``.
    Imports its module (torch, for the built-in ones; the user's code, for a plug-in)."""
    check(kind, name)
    if is_plugin(name):
        from hpc_ddp.train import plugins

        return plugins.builder(kind, plugin_spec.parse(kind, name))
    module, _, attr = _ENTRIES[kind][name].partition(":")
    builder: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return builder
