"""The CUDA libraries' first-use costs, paid on a thread while the process group comes up.

Why: the first training step of a process pays once for what CUDA and PyTorch do lazily:
loading cuDNN's and cuBLAS's libraries and creating their handles, loading each kernel's module
on its first launch (CUDA's lazy module loading), and building cuDNN's execution plans for
every convolution shape. For the LeNet benchmark on 4 GPUs that made the first epoch take
0.46 s against 0.08 s for each later one (benchmarks/README.md). Joining the process group is
mostly waiting on the other ranks and the NCCL communicator, so a thread that runs the run's
model forward and backward once, with an optimizer step, on zeros of the run's batch shape,
and the evaluation's forward at its batch size, takes those costs off the critical path.

Exactness: the thread builds the model on PyTorch's meta device (which draws nothing from any
random generator), materialises it on the GPU as zeros and feeds it zeros; it reads and writes
nothing of the run's state. It runs on the default stream, so the memory it frees is reused by
the run. The trainer joins it before building the run's own model, so no capture or training
kernel ever overlaps it. Any failure only costs the warm-up (logged at debug level).

Only built-in models on registered datasets are warmed (a plug-in's input shape is known only
once its data is read, and its code is not run on a thread); one GPU per process.
``HPC_DDP_CUDA_WARMUP=0`` turns it off (for A/B measurements).
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from hpc_ddp.env_vars import CUDA_WARMUP_VAR
from hpc_ddp.log import get_logger
from hpc_ddp.runtime import rng
from hpc_ddp.train import registry
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.optim import amp_dtype, build_optimizer

log = get_logger("train")


class CudaWarmup:
    """``start(config, device)`` before the process group; ``join()`` before the model."""

    def __init__(self, config: TrainConfig, device: torch.device, shape: registry.Shape) -> None:
        self._config, self._device, self._shape = config, device, shape
        self._thread = threading.Thread(target=self._run, name="cuda-warmup", daemon=True)

    @classmethod
    def start(cls, config: TrainConfig, device: torch.device, devices: int) -> CudaWarmup | None:
        """Start the thread where it applies (see the module docstring), else None."""
        shape = registry.dataset_shape(config.dataset)
        if (
            os.environ.get(CUDA_WARMUP_VAR) == "0"
            or device.type != "cuda"
            or devices != 1
            or shape is None
            or registry.is_plugin(config.model)
        ):
            return None
        if config.deterministic:  # cuBLAS reads its workspace setting at its first use: here
            rng.use_deterministic_kernels()
        warmup = cls(config, device, shape)
        warmup._thread.start()
        return warmup

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        try:
            with torch.cuda.device(self._device):
                self._forward_backward_step()
                torch.cuda.current_stream().synchronize()
        except Exception as err:  # only the warm-up is lost; the run pays on its first step
            log.debug(f"CUDA warm-up skipped: {type(err).__name__}: {err}")

    def _forward_backward_step(self) -> None:
        from hpc_ddp.cifar import models

        cfg, device = self._config, self._device
        sample, num_classes = self._shape
        with torch.device("meta"):
            net = models.build_model(cfg.model, num_classes, sync_bn=False)
        net = net.to_empty(device=device)
        with torch.no_grad():
            for tensor in [*net.parameters(), *net.buffers()]:
                tensor.zero_()
        amp = amp_dtype(cfg, device)
        autocast = torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None)
        x = torch.zeros(cfg.batch_size, *sample, device=device)
        y = torch.zeros(cfg.batch_size, dtype=torch.long, device=device)
        with autocast:
            loss = F.cross_entropy(net(x).float(), y, reduction="sum")
        loss.backward()
        build_optimizer(cfg, net.parameters()).step()
        net.eval()
        with torch.no_grad(), autocast:
            net(torch.zeros(cfg.eval_batch_size, *sample, device=device))
