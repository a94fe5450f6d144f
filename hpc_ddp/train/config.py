"""TrainConfig: trainer settings; defaults < config file (JSON/TOML) < command-line flags.

Pure Python (no torch) so that the deploy layer can build and validate a config cheaply.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp import parse_signal, schema
from hpc_ddp.env_vars import GPUS_PER_PROCESS_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.schema import field_doc
from hpc_ddp.train import registry

OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("cosine", "constant")
AMP_MODES = ("auto", "off", "bf16", "fp16")
REQUEUE_MODES = ("auto", "scontrol", "none")
DATA_PATHS = ("auto", "gpu", "torchvision")
CUDA_GRAPHS_MODES = ("auto", "on", "off")
# hpc_ddp.runtime.fast_step.MEMORY_FORMATS, spelled again: no torch import here
MEMORY_FORMATS = ("auto", "channels_last", "contiguous")
# hpc_ddp.train.cifar.synthetic.VARIANTS, spelled again: no numpy import here
SYNTHETIC_VARIANTS = ("easy", "hard")
# Where rank 0 writes the metrics it logs (train/metric_writers.py); jsonl is always written.
METRICS_FORMATS = ("jsonl", "csv", "tensorboard")

# Settings that define *which* run this is. Resuming (or re-entering a finished run dir) with any
# of them changed would silently mix two experiments, so the trainer refuses instead. ``epochs``
# is where the run ends, not which run it is: a run continues to a new end (run_dir_rules.py).
IDENTITY_KEYS = (
    "dataset",
    "synthetic",
    "synthetic_train_size",
    "synthetic_test_size",
    "synthetic_variant",
    "image_size",
    "model",
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
    "fsdp",  # a sharded checkpoint does not load into a DDP run, nor a whole one into FSDP
)


# Counts of optimizer steps (warm-up, checkpoint and log intervals): a billion is beyond any run.
STEPS = 10**9
# Samples a synthetic split may hold: 3 GB of 32x32 RGB images, twenty times CIFAR-10's.
SYNTHETIC_SAMPLES = schema.Range(1, 1_000_000)
# Samples per batch on one process.
BATCH = schema.Range(1, 65_536)


@dataclass
class TrainConfig:
    """Every trainer setting. Field metadata carries the flag help; see docs/training.md."""

    run_dir: str = field(
        default="runs/train", metadata=field_doc("run directory (checkpoints, results)")
    )
    data_dir: str = field(
        default="data",
        metadata=field_doc(
            "directory holding cifar-10-batches-py/ etc. (imagefolder: train/ and test/)"
        ),
    )
    dataset: str = field(
        default="cifar10",
        metadata=field_doc(f"{', '.join(registry.names('dataset'))} or MODULE:FUNCTION (your own)"),
    )
    synthetic: bool = field(
        default=False,
        metadata=field_doc(
            "write a synthetic, learnable dataset in CIFAR's on-disk format and use it"
        ),
    )
    synthetic_train_size: int = field(
        default=5000, metadata=field_doc("synthetic training samples", range=SYNTHETIC_SAMPLES)
    )
    synthetic_test_size: int = field(
        default=1000, metadata=field_doc("synthetic test samples", range=SYNTHETIC_SAMPLES)
    )
    synthetic_variant: str = field(
        default="easy",
        metadata=field_doc(
            "synthetic data: easy (learnt in an epoch) or hard "
            "(LeNet on CIFAR-100: about 45 percent in 10 epochs)"
        ),
    )
    image_size: int = field(
        default=0,
        metadata=field_doc(
            "imagefolder: the side every image is resized to (0: the files' own, all one "
            "square size); with --synthetic, the side of the images written (0: 64)",
            range=schema.Range(0, 1024),
        ),
    )
    download: bool = field(
        default=True, metadata=field_doc("download the dataset if it is missing")
    )
    model: str = field(
        default="lenet",
        metadata=field_doc(f"{', '.join(registry.names('model'))} or MODULE:FUNCTION (your own)"),
    )
    epochs: int = field(
        default=10, metadata=field_doc("training epochs", range=schema.Range(1, 100_000))
    )
    batch_size: int = field(
        default=64, metadata=field_doc("micro-batch size per process", range=BATCH)
    )
    accum_steps: int = field(
        default=1,
        metadata=field_doc(
            "micro-batches per optimizer step (gradient accumulation)",
            range=schema.Range(1, 65_536),
        ),
    )
    eval_batch_size: int = field(
        default=256, metadata=field_doc("evaluation batch size per process", range=BATCH)
    )
    # AdamW 1e-3 trains both models well out of the box; SGD 0.05 (a ResNet recipe) leaves LeNet
    # oscillating near 20-30 % accuracy. The ResNet jobs in jobs/ ask for SGD explicitly.
    optimizer: str = field(default="adam", metadata=field_doc(f"one of {', '.join(OPTIMIZERS)}"))
    lr: float = field(
        default=1e-3,
        metadata=field_doc("peak learning rate", range=schema.Range(0, 100, above=True)),
    )
    momentum: float = field(
        default=0.9, metadata=field_doc("SGD momentum", range=schema.Range(0, 1))
    )
    weight_decay: float = field(
        default=5e-4, metadata=field_doc("weight decay", range=schema.Range(0, 10))
    )
    lr_schedule: str = field(default="cosine", metadata=field_doc(f"one of {', '.join(SCHEDULES)}"))
    warmup_steps: int = field(
        default=0, metadata=field_doc("linear warm-up steps", range=schema.Range(0, STEPS))
    )
    augment: bool = field(default=True, metadata=field_doc("random crop + horizontal flip"))
    amp: str = field(
        default="auto", metadata=field_doc("auto (bf16 on GPU, off on CPU), off, bf16 or fp16")
    )
    sync_bn: bool = field(default=False, metadata=field_doc("convert BatchNorm to SyncBatchNorm"))
    seed: int = field(
        default=0,
        metadata=field_doc(
            "seed for init, data order and augmentation",
            range=schema.Range(0, 2**32 - 1, why="numpy's seeds"),
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=field_doc(
            "deterministic cuDNN/cuBLAS kernels (slower): two runs on GPUs, or a run and its "
            "preempted-and-resumed twin, end with the same weights bit for bit"
        ),
    )
    # Not given: chosen from the cores for a dataset decoded from files (loader_settings.py),
    # none for one held in memory.
    num_workers: int | None = field(
        default=None,
        metadata=field_doc(
            "DataLoader worker processes (not given: from the cores per process for image "
            "folders, 0 for data in memory)",
            range=schema.Range(0, 256),
        ),
    )
    data_path: str = field(
        default="auto",
        metadata=field_doc(
            "auto (GPU-resident when it fits, else torchvision), gpu or torchvision"
        ),
    )
    # auto: captured whenever the run qualifies (hpc_ddp/train/fast/cuda_graphs.py: choose), else
    # eager DDP with one log line saying why.
    cuda_graphs: str = field(
        default="auto",
        metadata=field_doc(
            "capture each step (with its all-reduce) as a CUDA graph: auto (whenever the run "
            "qualifies: a CUDA GPU per process, adam or sgd, accum 1, no fp16 or SyncBN), "
            "--cuda-graphs forces it (an error where it cannot), --no-cuda-graphs runs eager DDP",
            choices=CUDA_GRAPHS_MODES,
            switch=("on", "off"),
        ),
    )
    # hpc_ddp.speed_up, applied to the model and optimizer (train/fast/choice.py: speed_up); said
    # in one log line beside the CUDA graphs one.
    memory_format: str = field(
        default="auto",
        metadata=field_doc(
            "the model's memory format and the GPU-resident batches': auto (channels_last for a "
            "model whose 2-D convolutions have 8-channel multiples, on a CUDA GPU; a plug-in "
            "model only if its forward of a training input runs in it), channels_last or "
            "contiguous",
            choices=MEMORY_FORMATS,
        ),
    )
    fused_optimizer: bool = field(
        default=True,
        metadata=field_doc(
            "the optimizer's fused CUDA kernel (sgd, adam) on GPUs; --no-fused-optimizer keeps "
            "the multi-tensor one in eager steps (the captured step keeps its own kernels)"
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=field_doc(
            "shard the model's weights, gradients and optimizer state over the processes with "
            "FSDP2 (fully_shard per block, then the root) instead of DDP; checkpoints are "
            "sharded (every rank writes its shards) and resume on any number of processes"
        ),
    )
    time_allreduce: bool = field(
        default=False,
        metadata=field_doc(
            "time DDP's gradient all-reduce (a Python comm hook per bucket; on NCCL it costs "
            "host time per step, so it is off unless asked for; Gloo runs always have it)"
        ),
    )
    checkpoint_every_steps: int = field(
        default=0,
        metadata=field_doc(
            "also checkpoint every N optimizer steps (0: epoch ends only)",
            range=schema.Range(0, STEPS),
        ),
    )
    # A second: every epoch of real training is saved; epochs of a tenth of a second are not
    # each worth a checkpoint that costs a few ms on and beside the training path.
    checkpoint_interval_s: float = field(
        default=1.0,
        metadata=field_doc(
            "epoch-end checkpoints once this many seconds of training have passed since the "
            "newest checkpoint (0: at every epoch end); the last epoch, preemptions and "
            "--checkpoint-every-steps always save",
            range=schema.Range(0, schema.YEAR_S),
        ),
    )
    keep_checkpoints: int = field(
        default=2,
        metadata=field_doc(
            "checkpoints to keep",
            range=schema.Range(
                2, 10_000, why="at least 2, so a torn newest checkpoint falls back to the previous"
            ),
        ),
    )
    # On by default: the same files as a synchronous save (tests/test_checkpoint_async.py), and
    # every wait point (next save, preemption, end of training) waits for the write to commit.
    async_checkpoint: bool = field(
        default=True,
        metadata=field_doc(
            "copy the state at a save and write it in a background thread "
            "(--no-async-checkpoint: write before training goes on)"
        ),
    )
    log_every: int = field(
        default=20,
        metadata=field_doc("progress line every N steps (rank 0)", range=schema.Range(1, STEPS)),
    )
    metrics: list[str] = field(
        default_factory=lambda: ["jsonl"],
        metadata=field_doc(
            "metrics files beside metrics.jsonl (always written), comma-separated: csv "
            "(metrics.csv), tensorboard (tensorboard/; needs hpc-ddp[tensorboard])",
            split=",",
        ),
    )
    # Off where nobody looks at it (sweeps, CI): no helper process importing matplotlib beside
    # rank 0's training.
    plot: bool = field(
        default=True,
        metadata=field_doc("draw plot.png (loss and accuracy per epoch) when the run finishes"),
    )
    requeue: str = field(
        default="auto",
        metadata=field_doc("after a preemption checkpoint: auto, scontrol (Slurm) or none"),
    )
    requeue_signals: list[str] = field(
        default_factory=lambda: ["SIGUSR1", "SIGTERM"],
        metadata=field_doc(
            "signals that mean 'checkpoint and requeue' (e.g. USR1,TERM)",
            flag="--requeue-signal",
            split=",",
        ),
    )
    backend: str | None = field(default=None, metadata=field_doc("process-group backend override"))
    gpus_per_process: int | None = field(
        default=None,
        metadata=field_doc(
            f"GPUs one process drives, >1 splits the model (not given or 0: "
            f"${GPUS_PER_PROCESS_VAR}, else 1)",
            range=schema.Range(0, schema.MAX_PER_NODE),
        ),
    )
    timeout_s: float = field(
        default=1800.0,
        metadata=field_doc(
            "collective timeout (seconds)", range=schema.Range(0, schema.YEAR_S, above=True)
        ),
    )
    connect_timeout_s: float = field(
        default=120.0,
        metadata=field_doc(
            "rendezvous timeout (seconds)", range=schema.Range(0, schema.YEAR_S, above=True)
        ),
    )
    debug_hold_at_step: int = field(
        default=0,
        metadata=field_doc(
            "testing: at this global step wait (<=120 s) for a requeue signal",
            range=schema.Range(0, STEPS),
        ),
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        choices = {
            "optimizer": OPTIMIZERS,
            "lr_schedule": SCHEDULES,
            "amp": AMP_MODES,
            "requeue": REQUEUE_MODES,
            "data_path": DATA_PATHS,
            "synthetic_variant": SYNTHETIC_VARIANTS,
            "cuda_graphs": CUDA_GRAPHS_MODES,
            "memory_format": MEMORY_FORMATS,
        }
        registry.check("dataset", self.dataset)
        registry.check("model", self.model)
        if self.synthetic and registry.is_plugin(self.dataset):
            raise ConfigError(
                f"--synthetic writes CIFAR's files; dataset={self.dataset!r} is a plug-in",
                hint="drop --synthetic (a plug-in dataset makes its own data)",
            )
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"{key}={getattr(self, key)!r} is not valid",
                    hint=f"use one of: {', '.join(allowed)}",
                )
        numbers = schema.number_problems(self)
        if numbers:
            raise ConfigError(
                "; ".join(numbers), hint="`hpc-ddp train --help` shows every setting's range"
            )
        fsdp = fsdp_problems(self)
        if fsdp:
            raise ConfigError(
                "--fsdp cannot run with " + "; ".join(fsdp),
                hint="change those settings, or drop --fsdp (the default: DDP)",
            )
        self.requeue_signals = [parse_signal(s).name for s in self.requeue_signals]
        self.metrics = metrics_formats(self.metrics)
        self.gpus_per_process = schema.gpus_per_process_setting(self.gpus_per_process)  # 0 -> None

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


def fsdp_problems(cfg: TrainConfig) -> list[str]:
    """The settings an FSDP2 run cannot take, each with the reason (empty without ``fsdp``).
    One process driving several GPUs through the environment is refused where the trainer
    starts (hpc_ddp/train/sharding.py), as only there is it known."""
    if not cfg.fsdp:
        return []
    problems = []
    if cfg.cuda_graphs == "on":
        problems.append(
            "--cuda-graphs: FSDP2's gathers of the weights are not captured (drop it: an FSDP2 "
            "step is eager)"
        )
    if cfg.time_allreduce:
        problems.append("--time-allreduce: it times DDP's all-reduce, which FSDP2 replaces")
    if cfg.sync_bn:
        problems.append("--sync-bn: SyncBatchNorm is DDP's")
    if cfg.amp == "fp16":
        problems.append(
            "--amp fp16: its loss scaler is not made for sharded gradients (use bf16, which "
            "needs none)"
        )
    if cfg.gpus_per_process is not None and cfg.gpus_per_process > 1:
        problems.append(
            f"--gpus-per-process {cfg.gpus_per_process}: FSDP2 shards over processes of one GPU "
            "each (use 1)"
        )
    return problems


def metrics_formats(names: list[str]) -> list[str]:
    """``--metrics`` checked and in one order, jsonl always among them: ['jsonl', 'csv']."""
    unknown = [name for name in names if name not in METRICS_FORMATS]
    if unknown:
        raise ConfigError(
            f"metrics: unknown format(s) {', '.join(map(repr, unknown))}",
            hint=f"use a comma-separated list of: {', '.join(METRICS_FORMATS)} "
            "(e.g. --metrics csv,tensorboard)",
        )
    return [name for name in METRICS_FORMATS if name == "jsonl" or name in names]


def field_names() -> list[str]:
    return schema.field_names(TrainConfig)


def from_mapping(values: dict[str, Any], *, base: TrainConfig | None = None) -> TrainConfig:
    """Build a config from a mapping (file or API); unknown keys fail listing the valid ones."""
    return TrainConfig(**schema.from_mapping(TrainConfig, values, source="settings", base=base))


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or TOML config file; a [train] table is used when the file has one."""
    return schema.load_file(path, what="config file", section="train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (--batch-size ...). Defaults are SUPPRESSed: only given flags override."""
    parser.add_argument("--config", help="JSON or TOML file of settings (flags win over it)")
    schema.add_arguments(parser, TrainConfig)


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < --config file < flags."""
    base = from_mapping(load_file(args.config)) if getattr(args, "config", None) else TrainConfig()
    given = schema.given_values(args, TrainConfig)
    return dataclasses.replace(base, **given) if given else base
