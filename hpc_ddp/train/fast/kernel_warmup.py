"""CUDA's one-time costs paid on a thread while the process group comes up.

A process's first training step on a GPU loads cuDNN and cuBLAS, creates their handles, starts
autograd's device thread and loads the module of each kernel at its first launch (CUDA's lazy
loading): for a small model the first step takes far longer than the next ones, and with the
first evaluation's new kernels it is most of what makes a short run's first epoch longer than
the rest (benchmarks/NOTES.md). Meanwhile the process group's start, which is longer still,
waits on its peers with the GPU idle. ``KernelWarmup`` runs a miniature of the trainer's step in
that wait: the GPU data path's conversion, augmentation draws and gathers, convolution, batch
norm, pooling, linear, cross-entropy and backward (under the run's autocast, in the run's memory
format), the run's optimizer as the step will call it, and evaluation's reductions, on zeros of
its own.

It changes nothing the run computes: no random number generator is drawn from and no tensor of the
run is touched (tests/test_kernel_warmup.py). ``finish()`` joins the thread once the process group
is up, because a CUDA graph capture forbids other threads' CUDA work; what is left of start-up does
not overlap it. A failed warm-up is logged and costs nothing else: the step then loads what it needs
itself, as it would without a warm-up. It is the process's first cuBLAS user, so ``train()`` makes a
``--deterministic`` run's kernel settings before starting it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from hpc_ddp import CapturedStep, DistEnv, process_device, speed_up
from hpc_ddp.log import get_logger
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast import cuda_graphs
from hpc_ddp.train.optim import amp_dtype, build_optimizer

log = get_logger("train")

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def optimizer_factory(config: TrainConfig, *, captured: bool) -> MakeOptimizer:
    """The run's optimizer as its step will call it: ``optim.build_optimizer``'s, fused as
    ``hpc_ddp.speed_up`` makes it (``fused_optimizer``), made capturable (and fused) for the
    captured step, whose kernels those are."""

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = build_optimizer(config, params)
        if captured:
            CapturedStep.make_capturable(optimizer, params[0].device)
            return optimizer
        holder = nn.ParameterList(params)  # speed_up reads the device from a module
        fused = config.fused_optimizer
        return speed_up(holder, optimizer, memory_format="contiguous", fused=fused, log=_quiet)[1]

    return make


def _quiet(_line: str) -> None:
    """The warm-up's speed_up says nothing: the run's own says its choice."""


def warms_channels_last(config: TrainConfig) -> bool:
    """Whether the run's convolutions may be channels_last (``hpc_ddp.speed_up``; every
    built-in model has convolutions), so that the warm-up loads those kernels."""
    return config.memory_format != "contiguous"


def warm_kernels(
    device: torch.device,
    make_optimizer: MakeOptimizer,
    amp: torch.dtype | None,
    layout: torch.memory_format = torch.contiguous_format,
) -> None:
    """One miniature training step and evaluation on ``device``, on tensors made for it, its
    convolution in ``layout`` (the run's)."""
    from hpc_ddp.train.fast.gpu_data import (  # GPU runs only: CPU ones never import it here
        augment_params,
        crop_flip,
        normalize,
        take,
    )

    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        raw = torch.zeros(32, 3, 8, 8, dtype=torch.uint8, device=device)
        labels = torch.zeros(32, dtype=torch.int64, device=device)
        # More than 16 indices: CUDA's index_select takes another kernel for 16 or fewer, and
        # the data path gathers whole batches.
        pick = torch.arange(32, device=device)
        x, y = normalize(raw).index_select(0, pick), labels.index_select(0, pick)
        x = x.contiguous(memory_format=layout)
        # The augmentation's draws (integer hashing) and its gather, at CIFAR's size.
        images = normalize(torch.zeros(32, 3, 32, 32, dtype=torch.uint8, device=device))
        fill = torch.zeros(3, device=device)
        crop_flip(take(images.contiguous(memory_format=layout), pick),
                  augment_params(pick, seed=0, epoch=0), fill)  # fmt: skip
        conv_w = nn.Parameter(
            torch.zeros(4, 3, 3, 3, device=device).contiguous(memory_format=layout)
        )
        bn_w, bn_b = (
            nn.Parameter(torch.ones(4, device=device)),
            nn.Parameter(torch.zeros(4, device=device)),
        )
        fc_w = nn.Parameter(torch.zeros(10, 16, device=device))
        fc_b = nn.Parameter(torch.zeros(10, device=device))
        params = [conv_w, bn_w, bn_b, fc_w, fc_b]
        optimizer = make_optimizer(params)
        running = torch.zeros(4, device=device), torch.ones(4, device=device)

        def forward(training: bool) -> torch.Tensor:
            autocast = torch.autocast(device.type, dtype=amp, enabled=amp is not None)
            with autocast:
                h = F.conv2d(x, conv_w, padding=1)
                h = F.batch_norm(h, *running, bn_w, bn_b, training=training)
                h = F.max_pool2d(F.relu(h), 4).flatten(1)
                return F.linear(h, fc_w, fc_b)

        loss = F.cross_entropy(forward(True).float(), y, reduction="sum")
        (loss / y.shape[0]).backward()
        optimizer.step()
        with torch.no_grad():
            out = forward(False).float()
            total = F.cross_entropy(out, y, reduction="sum").double()
            correct = out.argmax(dim=1).eq(y).sum().double()
            host = torch.tensor([1.0], dtype=torch.float64).to(device)
            torch.cat([torch.stack([total, correct]), host])
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class KernelWarmup:
    """``start()`` (or ``launch()``) before the process group, ``finish()`` once it is up."""

    def __init__(
        self,
        devices: Sequence[torch.device],
        make_optimizer: MakeOptimizer,
        amp: torch.dtype | None,
        layouts: Sequence[torch.memory_format] = (torch.contiguous_format,),
    ) -> None:
        self.devices = list(devices)
        self.make_optimizer = make_optimizer
        self.amp = amp
        self.layouts = list(layouts)
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kernel-warmup", daemon=True)

    @classmethod
    def start(cls, config: TrainConfig, env: DistEnv) -> KernelWarmup | None:
        """Start the thread for a GPU process (None on CPU, or for a run the trainer will
        refuse: the refusal, with its message, comes once the process group is up)."""
        device = process_device(env)
        choice = cuda_graphs.choose_before_start(config, env)
        if device.type != "cuda" or choice is None:
            return None
        devices = [torch.device("cuda", index) for index in env.gpus] or [device]
        make = optimizer_factory(config, captured=choice.captured)
        layouts = [torch.contiguous_format]
        if warms_channels_last(config):  # speed_up decides on the model, built later: both
            layouts.append(torch.channels_last)
        return cls(devices, make, amp_dtype(config, device), layouts).launch()

    def launch(self) -> KernelWarmup:
        self._thread.start()
        return self

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            for device in self.devices:
                for layout in self.layouts:
                    warm_kernels(device, self.make_optimizer, self.amp, layout)
        except Exception as err:  # the step will load what it needs itself
            self.error = err
        self.seconds = time.perf_counter() - began

    def finish(self) -> None:
        """Wait for the thread: after this, no other thread runs CUDA work of ours."""
        self._thread.join()
        if self.error is not None:
            log.warning(
                f"the CUDA warm-up failed, so the first step loads its kernels: {self.error!r}"
            )
        else:
            log.debug(f"CUDA warm-up: {self.seconds:.3f} s on a thread beside the process group")
