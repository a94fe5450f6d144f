"""How the project records a CUDA graph (the captured step, the trainer's evaluation graphs): one
place for the capture's settings."""

from __future__ import annotations

from typing import Any

import torch

# Other threads go on while a graph is captured: a DataLoader's pin-memory thread allocates
# pinned host memory for each batch, which CUDA refuses during any capture in its default
# ("global") mode, failing the run at random. Only the capturing thread's calls are checked.
CAPTURE_MODE = "thread_local"


def recording(graph: torch.cuda.CUDAGraph, pool: Any = None) -> torch.cuda.graph:
    """``with recording(graph):`` records what the block launches into ``graph``."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_MODE)
