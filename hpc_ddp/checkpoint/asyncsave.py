"""Asynchronous saves: a snapshot queued to CPU memory, then the commit protocol in a thread.

The training thread pays only for queueing :func:`start_snapshot` (copies of what this rank
writes, in stream order, no wait for the GPU); one background thread per rank waits for the
copies and moves them to host memory, then runs the unchanged write -> agree -> manifest ->
rename -> ``latest`` protocol on them, agreeing over a dedicated Gloo group so its collectives
never interleave with training's on the default group. See docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_IMMUTABLE = frozenset({bool, int, float, complex, str, bytes, type(None)})

# A snapshot is staged in GPU memory when it takes at most this share of the free memory.
DEVICE_STAGING_SHARE = 0.25

# The background thread takes a pack's pinned host memory in pieces of at most this size (or one
# tensor, if larger), pausing after each piece that CUDA had to pin anew: while CUDA pins memory
# it holds up every other thread's kernel launches, so pinning a whole state at once held the
# training thread up at a process's first save for as long as pinning took, which grows with the
# state; small pieces with a pause between them let its launches through (benchmarks/NOTES.md,
# the first save's pinned allocation). Later saves reuse the pieces from torch's cache of pinned
# blocks, with no pause.
PIN_PIECE_BYTES = 8 << 20
PIN_PAUSE_S = 0.001


@dataclass
class _Slot:
    """The place of the snapshot's ``index``-th CUDA tensor, filled with its host copy."""

    index: int


@dataclass
class _Pack:
    """The snapshot's CUDA tensors of one device and dtype, copied by one ``torch.cat`` into one
    flat buffer: a state dict is hundreds of small tensors (ResNet-18 with Adam: ~300), and a
    clone each cost the training thread a kernel launch and an allocation per tensor."""

    flat: torch.Tensor
    members: list[int]  # the slots' indices, in the buffer's order
    shapes: list[torch.Size]

    def host_views(self, stream: torch.cuda.Stream) -> list[torch.Tensor]:
        """Copy the buffer into pinned host memory on ``stream``, a piece of whole tensors at a
        time (``pin_pieces``: an allocation and a copy each), and return the tensors as views
        of it, in their own shapes."""
        numels = [shape.numel() for shape in self.shapes]
        size = self.flat.element_size()
        views: list[torch.Tensor] = []
        start = 0
        for first, last in pin_pieces([n * size for n in numels], PIN_PIECE_BYTES):
            parts = numels[first:last]
            host = _pin(sum(parts), self.flat.dtype)
            with torch.cuda.stream(stream):
                host.copy_(self.flat[start : start + host.numel()], non_blocking=True)
            start += host.numel()
            pairs = zip(host.split(parts), self.shapes[first:last], strict=True)
            views += [part.view(shape) for part, shape in pairs]
        self.flat.record_stream(stream)  # its memory is reused only after these copies
        return views


def pin_pieces(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive tensors of ``sizes`` bytes cut into pieces of at most ``limit`` bytes, each
    (first tensor, one past its last); a tensor larger than ``limit`` is a piece of its own."""
    pieces: list[tuple[int, int]] = []
    first, total = 0, 0
    for i, size in enumerate(sizes):
        if i > first and total + size > limit:
            pieces.append((first, i))
            first, total = i, 0
        total += size
    if first < len(sizes):
        pieces.append((first, len(sizes)))
    return pieces


def _pin(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Pinned host memory for ``numel`` elements, then a pause if CUDA pinned it anew (torch's
    cache of pinned blocks answers in microseconds): other threads launch their kernels."""
    t0 = time.perf_counter()
    host = torch.empty(numel, dtype=dtype, pin_memory=True)
    if time.perf_counter() - t0 > PIN_PAUSE_S / 4:
        time.sleep(PIN_PAUSE_S)
    return host


@dataclass
class Snapshot:
    """A snapshot whose copies may still be in flight: :meth:`ready` waits and finishes them."""

    value: Any
    events: list[torch.cuda.Event] = field(default_factory=list)
    packs: list[_Pack] = field(default_factory=list)

    def ready(self) -> Any:
        for event in self.events:
            event.synchronize()
        if not self.packs:
            return self.value
        streams: dict[torch.device, torch.cuda.Stream] = {}
        copies: dict[int, torch.Tensor] = {}
        for pack in self.packs:
            device = pack.flat.device
            if device not in streams:
                streams[device] = torch.cuda.Stream(device)
            copies.update(zip(pack.members, pack.host_views(streams[device]), strict=True))
        for stream in streams.values():
            stream.synchronize()
        self.value, self.packs = _fill(self.value, copies), []
        return self.value


def start_snapshot(obj: Any, *, device_staging: bool | None = None) -> Snapshot:
    """Queue a copy of ``obj`` that training can no longer change, and return at once: every
    tensor copied, containers rebuilt, anything else deep-copied.

    GPU tensors are copied on their device's current stream without waiting for the GPU: the
    steps that follow run after the copies in stream order and cannot change what is copied.
    By default (``device_staging=None``) they are packed in GPU memory when the snapshot fits in
    DEVICE_STAGING_SHARE of the free memory: one ``torch.cat`` per device and dtype, a few
    kernel launches in all; :meth:`Snapshot.ready`, on the background save's thread, moves each
    pack to pinned host memory on a side stream, off the training thread (allocating that memory
    is the largest part of a first save: benchmarks/NOTES.md), in pieces (``PIN_PIECE_BYTES``).
    Otherwise each tensor is copied straight into pinned host memory on the training stream.
    Whoever reads the copy calls :meth:`Snapshot.ready` first.

    Values a checkpoint refuses (numpy arrays, functions) are deep-copied as they are: the
    background save's usual checks reject them, on every rank, at the next wait point.
    """
    cuda: list[torch.Tensor] = []
    out = _copy(obj, cuda)
    if device_staging is None:
        device_staging = _fits_on_devices(cuda)
    packs = _pack(cuda) if device_staging else []
    if not device_staging:
        out = _fill(out, dict(enumerate(_pinned(t) for t in cuda)))
    events = []
    for device in {t.device: None for t in cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return Snapshot(out, events, packs)


def _fits_on_devices(tensors: list[torch.Tensor]) -> bool:
    need: dict[torch.device, int] = {}
    for t in tensors:
        need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
    return all(
        size <= DEVICE_STAGING_SHARE * torch.cuda.mem_get_info(device)[0]
        for device, size in need.items()
    )


def _copy(obj: Any, cuda: list[torch.Tensor]) -> Any:
    """``obj`` rebuilt with its CPU tensors copied and each CUDA tensor appended to ``cuda`` and
    replaced by a slot for its copy. Runs on the training thread at every save: plain values
    are tested first, and a list of them (an RNG state: 625 ints) is copied in one go."""
    kind = type(obj)
    if kind in _IMMUTABLE:
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda:
            cuda.append(t)
            return _Slot(len(cuda) - 1)
        return t.to("cpu", copy=True)
    if kind is dict or kind is OrderedDict:
        return kind((k, _copy(v, cuda)) for k, v in obj.items())
    if kind is list or kind is tuple:
        if all(type(v) in _IMMUTABLE for v in obj):
            return kind(obj)
        return kind(_copy(v, cuda) for v in obj)
    return copy.deepcopy(obj)


def _pack(cuda: list[torch.Tensor]) -> list[_Pack]:
    """One pack per (device, dtype), filled on that device's current stream."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(cuda):
        groups.setdefault((t.device, t.dtype), []).append(i)
    packs = []
    for (device, dtype), members in groups.items():
        parts = [cuda[i].reshape(-1) for i in members]
        flat = torch.empty(sum(p.numel() for p in parts), dtype=dtype, device=device)
        with torch.cuda.device(device):  # that device's current stream: in stream order
            torch.cat(parts, out=flat)
        packs.append(_Pack(flat, members, [cuda[i].shape for i in members]))
    return packs


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A copy of CUDA tensor ``t`` into pinned host memory, queued on its device's stream."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _fill(obj: Any, copies: dict[int, torch.Tensor]) -> Any:
    """``obj`` with every slot replaced by its copy (containers rebuilt, the rest as is)."""
    if isinstance(obj, _Slot):
        return copies[obj.index]
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _fill(v, copies)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_fill(v, copies) for v in obj)
    return obj


class BackgroundSave:
    """One save, run by a :class:`SaveWorker`; :meth:`join` waits for it to end."""

    def __init__(self, step: int, body: Callable[[], Path]) -> None:
        self.step = step
        self.result: Path | None = None
        self.error: BaseException | None = None
        self._body: Callable[[], Path] | None = body
        self._done = threading.Event()

    def run(self) -> None:
        body, self._body = self._body, None  # the snapshot is freed when the save ends
        try:
            assert body is not None
            self.result = body()
        except BaseException as exc:  # reported by the training thread's next wait point
            self.error = exc
        finally:
            self._done.set()

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """True once the save has ended (always, without a timeout)."""
        return self._done.wait(timeout)


class SaveWorker:
    """One thread that runs a checkpointer's background saves in order, kept between saves: a
    thread started per save would make the training thread wait for it to come up at every save
    on a busy host. It ends after IDLE_S without work and is started again by the next save.

    While a save runs, the interpreter hands its lock between threads every SWITCH_INTERVAL_S
    instead of at Python's default interval: pickling and checking a checkpoint holds the lock,
    and the training thread, back from a wait on the GPU, would otherwise queue for up to a whole
    default interval to launch its next step while the GPU runs dry. None leaves Python's
    interval alone.
    """

    IDLE_S = 30.0
    SWITCH_INTERVAL_S: float | None = 0.0005

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[BackgroundSave] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit() against the thread's idle exit
        self._alive = False

    def submit(self, job: BackgroundSave) -> BackgroundSave:
        with self._lock:
            self._jobs.put(job)
            if not self._alive:
                self._alive = True
                threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        return job

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._alive = False
                        return
                continue
            with _switch_interval(self.SWITCH_INTERVAL_S):
                job.run()


# The interval is the interpreter's, not a thread's: saves of several Checkpointers (several
# SaveWorker threads) may overlap, and each restoring "its" previous value would leave another's
# in force. The first save to start sets it, the last to end puts back what was there before.
_INTERVAL_LOCK = threading.Lock()
_interval_users = 0
_interval_before = 0.0


@contextmanager
def _switch_interval(seconds: float | None) -> Iterator[None]:
    """``sys.setswitchinterval(seconds)`` while any save runs, the previous interval after."""
    global _interval_users, _interval_before
    if seconds is None:
        yield
        return
    with _INTERVAL_LOCK:
        if _interval_users == 0:
            _interval_before = sys.getswitchinterval()
            sys.setswitchinterval(seconds)
        _interval_users += 1
    try:
        yield
    finally:
        with _INTERVAL_LOCK:
            _interval_users -= 1
            if _interval_users == 0:
                sys.setswitchinterval(_interval_before)
