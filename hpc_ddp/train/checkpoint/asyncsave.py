"""Asynchronous saves: a snapshot queued to CPU memory, then the commit protocol in a thread.

The training thread pays only for queueing :func:`start_snapshot` (device-to-host copies of
what this rank writes, in stream order, no wait for the GPU); one background thread per rank
waits for the copies, then runs the unchanged write -> agree -> manifest -> rename -> ``latest``
protocol on them, agreeing over a dedicated Gloo group so its collectives never interleave with
training's on the default group. See docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Snapshot:
    """A snapshot whose device-to-host copies may still be in flight: :meth:`ready` waits."""

    value: Any
    events: list[torch.cuda.Event] = field(default_factory=list)

    def ready(self) -> Any:
        for event in self.events:
            event.synchronize()
        return self.value


def start_snapshot(obj: Any) -> Snapshot:
    """Queue a copy of ``obj`` that training can no longer change, and return at once: every
    tensor copied to CPU memory (pinned when it came from a GPU), containers rebuilt, anything
    else deep-copied.

    GPU tensors are copied non-blocking on their device's current stream, so the training
    thread never waits for the GPU here: the steps that follow run after the copies in stream
    order and cannot change what is copied. Whoever reads the copy calls :meth:`Snapshot.ready`
    first (the background save does, on its own thread).

    Values a checkpoint refuses (numpy arrays, functions) are deep-copied as they are: the
    background save's usual checks reject them, on every rank, at the next wait point.
    """
    devices: set[torch.device] = set()
    out = _copy(obj, devices)
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return Snapshot(out, events)


def _copy(obj: Any, devices: set[torch.device]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda:
            devices.add(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True)
    if isinstance(obj, (bool, int, float, complex, str, bytes, type(None))):
        return obj  # immutable
    if type(obj) in (dict, OrderedDict):
        items = [(k, _copy(v, devices)) for k, v in obj.items()]
        return OrderedDict(items) if type(obj) is OrderedDict else dict(items)
    if type(obj) in (list, tuple):
        return type(obj)(_copy(v, devices) for v in obj)
    return copy.deepcopy(obj)


class BackgroundSave:
    """One save running in its own thread; :meth:`join` returns its result or raises its error."""

    def __init__(self, step: int, body: Callable[[], Path]) -> None:
        self.step = step
        self.result: Path | None = None
        self.error: BaseException | None = None
        self._body: Callable[[], Path] | None = body
        self._thread = threading.Thread(
            target=self._run, name=f"hpc-ddp-checkpoint-{step}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        body, self._body = self._body, None  # the snapshot is freed when the save ends
        try:
            assert body is not None
            self.result = body()
        except BaseException as exc:  # reported by join() on the training thread
            self.error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """True once the thread has ended (always, without a timeout)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
