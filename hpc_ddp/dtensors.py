"""Whether tensors are DTensors (FSDP2's shards), without importing ``torch.distributed.tensor``.

No tensor can be a DTensor before that module is imported, and importing it costs a DDP run's
start-up about half a second per process (more beside the other ranks' imports), so every
check of the kind asks here first. Torch-free itself: it only looks at ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def dtensor_type() -> type | None:
    """DTensor's class, or None while ``torch.distributed.tensor`` is not imported."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def any_dtensor(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` is a DTensor."""
    kind = dtensor_type()
    return kind is not None and any(isinstance(t, kind) for t in tensors)
