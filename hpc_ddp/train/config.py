"""TrainConfig: trainer settings; defaults < config file (JSON/TOML) < command-line flags.

Pure Python (no torch) so that the deploy layer can build and validate a config cheaply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hpc_ddp.errors import ConfigError

DATASETS = ("cifar10", "cifar100")
MODELS = ("lenet", "resnet18")
OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("cosine", "constant")
AMP_MODES = ("auto", "off", "bf16", "fp16")
REQUEUE_MODES = ("auto", "scontrol", "none")
DATA_PATHS = ("auto", "gpu", "torchvision")
CUDA_GRAPHS_MODES = ("auto", "on", "off")
SYNTHETIC_VARIANTS = ("easy", "hard")  # hpc_ddp.train.synthetic.VARIANTS (no numpy import here)

# Settings that define *which* run this is. Resuming (or re-entering a finished run dir) with any
# of them changed would silently mix two experiments, so the trainer refuses instead.
IDENTITY_KEYS = (
    "dataset",
    "synthetic",
    "synthetic_train_size",
    "synthetic_test_size",
    "synthetic_variant",
    "model",
    "epochs",
    "batch_size",
    "accum_steps",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "lr_schedule",
    "warmup_steps",
    "augment",
    "amp",
    "sync_bn",
    "seed",
)


def _opt(help_text: str, **extra: Any) -> Any:
    return {"help": help_text, **extra}


@dataclass
class TrainConfig:
    """Every trainer setting. Field metadata carries the flag help; see docs/training.md."""

    run_dir: str = field(
        default="runs/train", metadata=_opt("run directory (checkpoints, results)")
    )
    data_dir: str = field(
        default="data", metadata=_opt("directory holding cifar-10-batches-py/ etc.")
    )
    dataset: str = field(default="cifar10", metadata=_opt(f"one of {', '.join(DATASETS)}"))
    synthetic: bool = field(
        default=False,
        metadata=_opt("write a synthetic, learnable dataset in CIFAR's on-disk format and use it"),
    )
    synthetic_train_size: int = field(default=5000, metadata=_opt("synthetic training samples"))
    synthetic_test_size: int = field(default=1000, metadata=_opt("synthetic test samples"))
    synthetic_variant: str = field(
        default="easy",
        metadata=_opt(
            "synthetic data: easy (learnt in an epoch) or hard "
            "(LeNet on CIFAR-100: about 45 percent in 10 epochs)"
        ),
    )
    download: bool = field(default=True, metadata=_opt("download the dataset if it is missing"))
    model: str = field(default="lenet", metadata=_opt(f"one of {', '.join(MODELS)}"))
    epochs: int = field(default=10, metadata=_opt("training epochs"))
    batch_size: int = field(default=64, metadata=_opt("micro-batch size per process"))
    accum_steps: int = field(
        default=1, metadata=_opt("micro-batches per optimizer step (gradient accumulation)")
    )
    eval_batch_size: int = field(default=256, metadata=_opt("evaluation batch size per process"))
    # AdamW 1e-3 trains both models well out of the box; SGD 0.05 (a ResNet recipe) leaves LeNet
    # oscillating near 20-30 % accuracy. The ResNet jobs in jobs/ ask for SGD explicitly.
    optimizer: str = field(default="adam", metadata=_opt(f"one of {', '.join(OPTIMIZERS)}"))
    lr: float = field(default=1e-3, metadata=_opt("peak learning rate"))
    momentum: float = field(default=0.9, metadata=_opt("SGD momentum"))
    weight_decay: float = field(default=5e-4, metadata=_opt("weight decay"))
    lr_schedule: str = field(default="cosine", metadata=_opt(f"one of {', '.join(SCHEDULES)}"))
    warmup_steps: int = field(default=0, metadata=_opt("linear warm-up steps"))
    augment: bool = field(default=True, metadata=_opt("random crop + horizontal flip"))
    amp: str = field(
        default="auto", metadata=_opt("auto (bf16 on GPU, off on CPU), off, bf16 or fp16")
    )
    sync_bn: bool = field(default=False, metadata=_opt("convert BatchNorm to SyncBatchNorm"))
    seed: int = field(default=0, metadata=_opt("seed for init, data order and augmentation"))
    num_workers: int = field(default=0, metadata=_opt("DataLoader worker processes"))
    data_path: str = field(
        default="auto",
        metadata=_opt("auto (GPU-resident when it fits, else torchvision), gpu or torchvision"),
    )
    # auto: captured whenever the run qualifies (hpc_ddp/train/cuda_graphs.py: choose), else
    # eager DDP with one log line saying why. True/False (files and code written when this was
    # a switch) mean on/off.
    cuda_graphs: str = field(
        default="auto",
        metadata=_opt(
            "capture each step (with its all-reduce) as a CUDA graph: auto (whenever the run "
            "qualifies: a CUDA GPU per process, adam or sgd, accum 1, no fp16 or SyncBN), "
            "--cuda-graphs forces it (an error where it cannot), --no-cuda-graphs runs eager DDP"
        ),
    )
    time_allreduce: bool = field(
        default=False,
        metadata=_opt(
            "time DDP's gradient all-reduce (a Python comm hook per bucket; on NCCL it costs "
            "host time per step, so it is off unless asked for; Gloo runs always have it)"
        ),
    )
    checkpoint_every_steps: int = field(
        default=0, metadata=_opt("also checkpoint every N optimizer steps (0: epoch ends only)")
    )
    keep_checkpoints: int = field(default=2, metadata=_opt("checkpoints to keep (>= 2)"))
    # On by default: the same files as a synchronous save (tests/test_checkpoint_async.py), and
    # every wait point (next save, preemption, end of training) waits for the write to commit.
    async_checkpoint: bool = field(
        default=True,
        metadata=_opt(
            "copy the state at a save and write it in a background thread "
            "(--no-async-checkpoint: write before training goes on)"
        ),
    )
    log_every: int = field(default=20, metadata=_opt("progress line every N steps (rank 0)"))
    requeue: str = field(
        default="auto",
        metadata=_opt("after a preemption checkpoint: auto, scontrol (Slurm) or none"),
    )
    requeue_signals: list[str] = field(
        default_factory=lambda: ["SIGUSR1", "SIGTERM"],
        metadata=_opt("signals that mean 'checkpoint and requeue' (e.g. USR1,TERM)"),
    )
    backend: str | None = field(default=None, metadata=_opt("process-group backend override"))
    gpus_per_process: int = field(
        default=0,
        metadata=_opt(
            "GPUs one process drives, >1 splits the model (0: $HPC_DDP_GPUS_PER_PROCESS or 1)"
        ),
    )
    timeout_s: float = field(default=1800.0, metadata=_opt("collective timeout (seconds)"))
    connect_timeout_s: float = field(default=120.0, metadata=_opt("rendezvous timeout (seconds)"))
    debug_hold_at_step: int = field(
        default=0,
        metadata=_opt("testing: at this global step wait (<=120 s) for a requeue signal"),
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        choices = {
            "dataset": DATASETS,
            "model": MODELS,
            "optimizer": OPTIMIZERS,
            "lr_schedule": SCHEDULES,
            "amp": AMP_MODES,
            "requeue": REQUEUE_MODES,
            "data_path": DATA_PATHS,
            "synthetic_variant": SYNTHETIC_VARIANTS,
            "cuda_graphs": CUDA_GRAPHS_MODES,
        }
        if isinstance(self.cuda_graphs, bool):
            self.cuda_graphs = "on" if self.cuda_graphs else "off"
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"{key}={getattr(self, key)!r} is not valid",
                    hint=f"use one of: {', '.join(allowed)}",
                )
        positive = ("epochs", "batch_size", "accum_steps", "eval_batch_size", "log_every")
        positive += ("synthetic_train_size", "synthetic_test_size")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        non_negative = ("num_workers", "checkpoint_every_steps", "warmup_steps", "gpus_per_process")
        for key in (*non_negative, "debug_hold_at_step"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0")
        if self.keep_checkpoints < 2:
            raise ConfigError(
                f"keep_checkpoints={self.keep_checkpoints} is too few",
                hint="keep at least 2 so a torn newest checkpoint can fall back to the previous",
            )
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be > 0")
        self.requeue_signals = [parse_signal(s).name for s in self.requeue_signals]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in IDENTITY_KEYS}

    def identity_changes(self, recorded: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """{key: (recorded, ours)} for each identity setting that differs from a recorded
        config (a run dir's config.json). A key missing from an older file had the default
        the setting got later."""
        defaults = TrainConfig().identity()
        was = {k: recorded.get(k, defaults[k]) for k in IDENTITY_KEYS}
        return {k: (was[k], getattr(self, k)) for k in IDENTITY_KEYS if was[k] != getattr(self, k)}


def parse_signal(name: str | int) -> signal.Signals:
    """'USR1', 'SIGUSR1', 'usr1' or 10 -> signal.SIGUSR1."""
    try:
        if isinstance(name, int) or str(name).isdigit():
            return signal.Signals(int(name))
        text = str(name).strip().upper()
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(
            f"unknown signal {name!r}", hint="use a name such as USR1, USR2 or TERM"
        ) from None


def field_names() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Check a file/API value against the field's type (from its default); ints may be floats."""
    kind = type(default)
    if name == "cuda_graphs" and isinstance(value, (bool, str)):
        return value  # validate() maps true/false to on/off and checks the name
    if name == "backend":
        if value is None or isinstance(value, str):
            return value
    elif isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, list):
        if isinstance(value, str):
            return [s for s in value.split(",") if s]
        if isinstance(value, list) and all(isinstance(v, (str, int)) for v in value):
            return list(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, kind) and not isinstance(value, bool):
        return value
    raise ConfigError(
        f"{name}={value!r} has the wrong type",
        hint=f"{name} takes a {kind.__name__} (default {default!r})",
    )


def from_mapping(values: dict[str, Any], *, base: TrainConfig | None = None) -> TrainConfig:
    """Build a config from a mapping (file or API); unknown keys fail listing the valid ones."""
    current = (base or TrainConfig()).to_dict()
    valid = field_names()
    normalized = {str(k).replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(normalized) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown setting(s): {', '.join(unknown)}", hint=f"valid settings: {', '.join(valid)}"
        )
    defaults = TrainConfig().to_dict()
    for key, value in normalized.items():
        current[key] = _coerce(key, value, defaults[key])
    return TrainConfig(**current)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or TOML config file (TOML needs Python 3.11+ or the tomli package)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist", hint="check the --config path")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = _toml_loads(text)
        else:
            raise ConfigError(
                f"config file {path} has an unknown type", hint="name it *.json or *.toml"
            )
    except (ValueError, TypeError) as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"cannot parse {path}: {err}", hint="fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a table/object of settings, not {type(data).__name__}")
    # A [train] table is accepted so one TOML file can also hold other sections.
    return data.get("train", data) if isinstance(data.get("train"), dict) else data


def _toml_loads(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(
                "TOML config files need Python 3.11+ or the tomli package",
                hint="pip install tomli, or write the config as JSON",
            ) from None
    return tomllib.loads(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (--batch-size ...). Defaults are SUPPRESSed: only given flags override."""
    parser.add_argument("--config", help="JSON or TOML file of settings (flags win over it)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {_default(f)!r})"
        if f.name == "cuda_graphs":
            _add_cuda_graphs_flags(parser, flag, help_text)
        elif f.name == "requeue_signals":
            parser.add_argument(
                "--requeue-signal",
                dest=f.name,
                default=argparse.SUPPRESS,
                type=lambda s: [x for x in s.split(",") if x],
                help=help_text,
            )
        elif isinstance(_default(f), bool):
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            kind = type(_default(f)) if _default(f) is not None else str
            parser.add_argument(
                flag, dest=f.name, type=kind, default=argparse.SUPPRESS, help=help_text
            )


def _add_cuda_graphs_flags(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """``--cuda-graphs`` (on), ``--cuda-graphs auto|on|off`` and ``--no-cuda-graphs`` (off)."""
    parser.add_argument(
        flag,
        dest="cuda_graphs",
        nargs="?",
        const="on",
        choices=CUDA_GRAPHS_MODES,
        default=argparse.SUPPRESS,
        help=help_text,
    )
    parser.add_argument(
        "--no-" + flag[2:],
        dest="cuda_graphs",
        action="store_const",
        const="off",
        default=argparse.SUPPRESS,
        help="run the eager DDP step (same as --cuda-graphs off)",
    )


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < --config file < flags."""
    base = from_mapping(load_file(args.config)) if getattr(args, "config", None) else TrainConfig()
    given = {k: v for k, v in vars(args).items() if k in field_names()}
    return dataclasses.replace(base, **given) if given else base
