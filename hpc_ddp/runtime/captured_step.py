"""``CapturedStep``: a training step (forward, backward, gradient all-reduce, optimizer) recorded as
a CUDA graph and replayed once per micro-batch, in place of ``DDP(model)`` in a loop of your own.

    net, opt = hpc_ddp.speed_up(net, opt)
    step = hpc_ddp.CapturedStep(net, opt, loss_fn=F.cross_entropy)
    for x, y in loader:
        loss = step(x.to(dev), y.to(dev))

Why: a small model needs little arithmetic per step, but eager PyTorch spends many times as long
launching its kernels from Python (autograd, DDP's hooks, the optimizer's loops;
benchmarks/NOTES.md). A replay launches all of them with one call, so the GPU sets the pace.

Same semantics as the eager DDP step, which is what makes it a drop-in:
- gradients are averaged over ranks as DDP does (sum of the ranks' gradients / world size), over
  one flat buffer that the parameters' ``.grad`` views (DDP's ``gradient_as_bucket_view``),
  bucket by bucket while backward runs, as DDP overlaps them (``grad_buckets``);
- rank 0's parameters and buffers are broadcast at construction, as DDP's constructor does;
- with ``accum_steps`` micro-batches per step, the earlier ones accumulate without an all-reduce
  (DDP's ``no_sync``), each loss divided by ``accum_steps``, and the last all-reduces and steps;
- every micro-batch is trained on exactly once: the first ``warmup`` optimizer steps run eagerly
  (on a side stream, to settle cuBLAS/cuDNN workspaces, NCCL communicators and the optimizer's
  state), each kind of micro-batch (first, middle, last of its step) is captured when it next
  comes and replayed from then on, and a capture itself runs nothing; the batch's shape is the
  first that comes twice in a row after the warm-up, and one more shape (an epoch's short last
  batch) is captured when it comes a second time; any other shape runs the same step eagerly;
- the learning rate becomes a 1-element device tensor (``capturable``), so LR schedulers keep
  working; a checkpoint of the optimizer is written as the eager one would be;
- autocast (bf16) runs inside the graph with its cast cache off, as graphs require.

Where a graph cannot keep that exact (a CPU, fp16's loss scaling, an optimizer without a
capturable kernel, a model across several devices, ...) the same step runs eagerly and the one
line the constructor logs says why.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpc_ddp.dist import close_before_end
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.runtime import capturable
from hpc_ddp.runtime import captured_checks as checks
from hpc_ddp.runtime.grad_buckets import BucketedAllReduce, flat_grads
from hpc_ddp.runtime.recording import recording

# A micro-batch's place in its step: (first: zero the gradients, last: all-reduce and step).
Phase = tuple[bool, bool]
Shapes = tuple[torch.Size, torch.Size]  # of the inputs and the targets
# Shapes with graphs of their own: the batch's, and an epoch's short last batch. Eager, that
# one step is a fixed cost per epoch, whose share grows as more GPUs shorten the epoch.
MAX_SHAPES = 2
# Shapes remembered as seen once (a second coming captures): bounded for inputs of varying shape.
MAX_SEEN = 64


class CapturedStep:
    """``loss = step(x, y)``: one micro-batch's forward, backward and, at the end of its step, the
    gradient all-reduce and the optimizer's step, as one CUDA graph replay (module docstring).

    ``model``: the bare module on its device (not DDP-wrapped: this replaces DDP), after
    ``hpc_ddp.speed_up`` if used. ``optimizer``: over the model's parameters. ``loss_fn(output,
    target)``: the scalar to minimise (default cross-entropy, its mean). ``amp_dtype``:
    ``torch.bfloat16`` runs forward and loss under autocast inside the graph; ``torch.float16``
    steps eagerly with a ``GradScaler`` (``scaler``: save its state for exact resume).
    ``accum_steps``: micro-batches per optimizer step; ``step(x, y, sync=True)`` ends a step
    early (an epoch's short last one), ``sync=False`` defers it. ``warmup``: eager steps before
    the capture (at least 1: the optimizer creates its state in its first step). ``capture=False``
    runs every step eagerly. ``allreduce_in_graph=False`` keeps the all-reduce out of the graph
    (two graphs around it), for NCCL builds that cannot capture it. ``log``: where the one line
    saying whether the step is captured goes (default: the ``hpc_ddp`` logger, rank 0's line).

    The loss returned is a device tensor that the next call overwrites (copying it would cost a
    launch per step, a share of a small model's step): read it (``.item()``), ``.clone()`` it or
    add it to an accumulator before the next call. Inputs must be on the model's device with
    the same shapes each step. Call ``close()`` (or use ``with``) before the process group is
    destroyed; ``hpc_ddp.end_process_group``, ``shutdown`` and ``run_main`` are safe without.
    Raises ``ConfigError`` for a wrapped or sharded model, an optimizer holding tensors that are
    not the model's parameters, LBFGS, and out-of-range settings.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: checks.LossFn | None = None,
        amp_dtype: torch.dtype | None = None,
        accum_steps: int = 1,
        warmup: int = 3,
        capture: bool = True,
        allreduce_in_graph: bool = True,
        log: Callable[[str], object] | None = None,
    ) -> None:
        checks.refuse_bad_input(model, optimizer, loss_fn, amp_dtype, accum_steps, warmup)
        self.model, self.optimizer = model, optimizer
        self.loss_fn: checks.LossFn = loss_fn or F.cross_entropy
        self.amp_dtype, self.accum_steps, self.warmup = amp_dtype, accum_steps, warmup
        self.allreduce_in_graph = allreduce_in_graph
        self.log = log or get_logger().info
        # Reversed: backward produces the last layers' gradients first, so the buckets that
        # fill first lie at the front of the buffer (grad_buckets).
        self.params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.device = self.params[0].device
        self.world_size = dist.get_world_size() if _grouped() else 1
        one_buffer = checks.why_not_one_buffer(self.params)
        self.flat = flat_grads(self.params) if one_buffer is None else None
        self._views = [p.grad for p in self.params]  # the .grad views into ``flat``
        self.buckets: BucketedAllReduce | None = None
        if self.flat is not None and self.world_size > 1 and allreduce_in_graph:
            self.buckets = BucketedAllReduce(self.params, self.flat, self.world_size)
        self.reason = checks.why_eager(  # None: captured
            model, optimizer, self.device, amp_dtype, self.world_size, allreduce_in_graph,
            capture, one_buffer,
        )  # fmt: skip
        self.scaler = torch.amp.GradScaler(self.device.type) if amp_dtype == torch.float16 else None
        _broadcast_from_rank0(model)
        self.loss: torch.Tensor | None = None
        self.replays = 0
        self.eager_steps = 0  # optimizer steps run eagerly since the last (re)start
        # Called before capture: CUDA refuses other threads' allocations of pinned memory while
        # a stream captures, so a background checkpoint save still copying to the host must
        # finish first.
        self.before_capture: Callable[[], object] | None = None
        self._static: dict[Shapes, tuple[torch.Tensor, torch.Tensor]] = {}  # replay inputs
        self._graphs: dict[tuple[Phase, Shapes], list[torch.cuda.CUDAGraph]] = {}
        self._pool: Any = None
        self._micro = 0  # micro-batches of the current step taken so far
        self._previous: Shapes | None = None  # the last batch's shapes
        self._seen: set[Shapes] = set()
        self._prepared = False  # make_capturable runs at the first step, after any restore
        self._given: list[dict[str, Any]] | None = None  # the flags before make_capturable
        self._lrs: list[torch.Tensor] = []  # the LR tensors the graphs read
        self._hyper: list[dict[str, Any]] = []  # the other settings the graphs baked in
        self._closed = False
        if self.reason is None:
            optimizer.register_state_dict_post_hook(self._saved)
            optimizer.register_load_state_dict_post_hook(self._loaded)
        if _grouped():
            close_before_end(self)
        self.line = (
            f"captured step: a CUDA graph after {warmup} eager warm-up step(s)"
            if self.reason is None
            else f"captured step: eager, not captured ({self.reason})"
        )
        self.log(self.line)

    # ---- what the caller sees ----
    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, *, sync: bool | None = None
    ) -> torch.Tensor:
        return self.step(x, y, sync=sync)

    def __enter__(self) -> CapturedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def captured(self) -> bool:
        """Whether steps are replayed as graphs (after the warm-up)."""
        return self.reason is None

    @property
    def graphs(self) -> list[torch.cuda.CUDAGraph]:
        """The graphs captured so far (one per kind of micro-batch; two where the all-reduce
        stays out of them)."""
        return [g for phase in self._graphs.values() for g in phase]

    @property
    def static_x(self) -> torch.Tensor | None:
        """The input buffer the batch-size graphs replay (None before the first capture)."""
        return next(iter(self._static.values()))[0] if self._static else None

    @property
    def pool(self) -> Any:
        """The memory pool the step's graphs share (None until the first capture): a graph of
        your own recorded with it (``record``) reuses their memory."""
        return self._pool

    @staticmethod
    def record(graph: torch.cuda.CUDAGraph, pool: Any = None) -> torch.cuda.graph:
        """``with CapturedStep.record(graph, pool=step.pool):`` records a graph of your own as
        the step records its (CUDA's thread-local capture mode: a DataLoader's pin-memory
        thread may go on allocating meanwhile)."""
        return recording(graph, pool)

    make_capturable = staticmethod(capturable.make_capturable)

    def step(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool | None = None) -> torch.Tensor:
        """One micro-batch (see the class docstring); returns its loss (a device tensor)."""
        if self._closed:
            raise ConfigError("this CapturedStep was closed", hint="build a new one to step again")
        phase = (self._micro == 0, self._micro + 1 >= self.accum_steps if sync is None else sync)
        self._micro = 0 if phase[1] else self._micro + 1
        if self.flat is not None and self.params[0].grad is not self._views[0]:
            self._repoint()
        if not self._prepared:  # after any checkpoint was restored into the optimizer
            self._prepare()
        if self.reason is None and phase[1] and self._graphs:
            changed = self._settings_changed()
            if changed is not None:
                self._go_eager(changed)
        shapes = (x.shape, y.shape)
        if not self._replays(shapes, x, y):
            self._eager(x, y, phase)
        else:
            if (phase, shapes) not in self._graphs:
                self._capture(phase, shapes)
            self._replay(x, y, phase, shapes)
        assert self.loss is not None  # the first micro-batch made it
        return self.loss

    def close(self) -> None:
        """Destroy the graphs and take the gradient hooks off the parameters. Call it before
        the process group is destroyed: NCCL keeps the resources of a captured all-reduce until
        its graph is gone, and ncclCommDestroy waits for them, so destroying the group first
        hangs for ever (benchmarks/NOTES.md). Idempotent; the step cannot be used after."""
        if self._closed:
            return
        self._closed = True
        if self.buckets is not None:
            self.buckets.remove()
        self._release_graphs()

    def _repoint(self) -> None:
        """A ``zero_grad()`` left in a loop from DDP set every ``.grad`` to None: the views
        into the buffer the all-reduce averages go back (same memory: graphs stay valid)."""
        for p, view in zip(self.params, self._views, strict=True):
            p.grad = view

    # ---- the step in three parts, identical whether run eagerly or recorded ----
    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, phase: Phase) -> None:
        first, last = phase
        if first:  # backward accumulates into the .grad views, so a step starts from zero
            if self.flat is not None:
                self.flat.zero_()
            else:
                for p in self.params:
                    p.grad = None
        if last and self.buckets is not None:
            self.buckets.begin()
        with self._autocast():
            loss = self.loss_fn(self.model(x), y)
        scaled = loss / self.accum_steps if self.accum_steps > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        if self.loss is None:  # made in the eager warm-up, never inside a capture
            self.loss = torch.zeros((), dtype=torch.float32, device=loss.device)
        self.loss.copy_(loss.detach())

    def _allreduce(self) -> None:
        """DDP's average: the sum of the ranks' gradients / world size."""
        if self.world_size == 1:
            return
        if self.buckets is not None:  # started during backward: the rest, then the average
            self.buckets.finish()
        elif self.flat is not None:
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
            self.flat.div_(self.world_size)
        else:
            for p in self.params:  # every rank reduces every tensor, used or not
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(self.world_size)

    def _update(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _micro_batch(self, x: torch.Tensor, y: torch.Tensor, phase: Phase) -> None:
        self._forward_backward(x, y, phase)
        if phase[1]:
            self._allreduce()
            self._update()

    # ---- eager, capture, replay ----
    def _autocast(self) -> AbstractContextManager:
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=False)

    def _replays(self, shapes: Shapes, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether this micro-batch replays a graph (else it runs eagerly). The first graphs
        take the first shapes that come twice in a row after the warm-up (an epoch's short
        last batch, which a resumed run may meet first, never does); then one more shape gets
        graphs when it comes a second time (that short batch, in the next epoch)."""
        previous, self._previous = self._previous, shapes
        again = shapes in self._seen
        if len(self._seen) < MAX_SEEN:
            self._seen.add(shapes)
        if self.reason is not None or self.eager_steps < self.warmup:
            return False
        if shapes in self._static:
            return True
        wanted = again and len(self._static) < MAX_SHAPES if self._static else shapes == previous
        if wanted:
            self._static[shapes] = (torch.empty_like(x), torch.empty_like(y))
        return wanted

    def _eager(self, x: torch.Tensor, y: torch.Tensor, phase: Phase) -> None:
        if self.reason is None:  # on a side stream, as torch.cuda.graph's documentation asks
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._micro_batch(x, y, phase)
            current.wait_stream(side)
        else:
            self._micro_batch(x, y, phase)
        self.eager_steps += int(phase[1])

    def _capture(self, phase: Phase, shapes: Shapes) -> None:
        static_x, static_y = self._static[shapes]
        if self.before_capture is not None:
            self.before_capture()
        if not self._graphs:
            self._snapshot()
        torch.cuda.synchronize(self.device)
        first = torch.cuda.CUDAGraph()
        with recording(first, pool=self._pool):
            self._forward_backward(static_x, static_y, phase)
            if phase[1] and self.allreduce_in_graph:
                self._allreduce()
                self._update()
        self._pool = first.pool() if self._pool is None else self._pool
        self._graphs[phase, shapes] = [first]
        if phase[1] and not self.allreduce_in_graph:
            second = torch.cuda.CUDAGraph()
            with recording(second, pool=self._pool):
                self._update()
            self._graphs[phase, shapes].append(second)

    def _replay(self, x: torch.Tensor, y: torch.Tensor, phase: Phase, shapes: Shapes) -> None:
        static_x, static_y = self._static[shapes]
        static_x.copy_(x)
        static_y.copy_(y)
        graphs = self._graphs[phase, shapes]
        graphs[0].replay()
        if len(graphs) > 1:
            self._allreduce()
            graphs[1].replay()
        self.replays += 1

    def _release_graphs(self) -> None:
        if self._graphs:
            torch.cuda.synchronize(self.device)
            for graph in self.graphs:
                graph.reset()
            self._graphs, self._pool = {}, None  # a new capture takes a new pool
            torch.cuda.synchronize(self.device)

    # ---- the optimizer as the graphs read it ----
    def _prepare(self) -> None:
        if self.reason is None:
            self._given = capturable.given_flags(self.optimizer)
            capturable.make_capturable(self.optimizer, self.device)
        self._prepared = True

    def _snapshot(self) -> None:
        """Before the first capture: the LR tensors the graphs will read (a float assigned
        during the warm-up becomes one again) and the settings they will bake in."""
        groups = self.optimizer.param_groups
        for group in groups:
            lr = group["lr"]
            if not isinstance(lr, torch.Tensor) or lr.device != self.device:
                group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=self.device)
        self._lrs = [group["lr"] for group in groups]
        self._hyper = [capturable.baked_settings(group) for group in groups]

    def _settings_changed(self) -> str | None:
        """What changed in the optimizer's settings since the capture that a replay would not
        see, or None. A new learning rate assigned as a float (a hand-written schedule) is
        copied into the tensor the graphs read."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self._lrs):
            return "the optimizer's parameter groups changed after the capture"
        for group, lr, settings in zip(groups, self._lrs, self._hyper, strict=True):
            if group["lr"] is not lr:
                lr.fill_(float(group["lr"]))
                group["lr"] = lr
            now = capturable.baked_settings(group)
            if now != settings:
                keys = sorted(
                    k for k in now.keys() | settings.keys() if now.get(k) != settings.get(k)
                )
                return f"the optimizer's {', '.join(keys)} changed after the capture"
        return None

    def _go_eager(self, why: str) -> None:
        """From now on every step runs eagerly: a graph would replay the settings it captured."""
        self.reason = why
        self._release_graphs()
        self.line = f"captured step: eager from now on ({why}; a graph keeps what it captured)"
        self.log(self.line)

    def _saved(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        if self._given is None:
            return state
        return capturable.saved_as_given(optimizer, state, self._given)

    def _loaded(self, _optimizer: torch.optim.Optimizer) -> None:
        """A load replaced the optimizer's groups and state: the graphs read the old ones, so
        the step prepares, warms up and captures again."""
        self._release_graphs()
        self._prepared, self._given, self.eager_steps = False, None, 0


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _broadcast_from_rank0(model: nn.Module) -> None:
    """What DDP's constructor does: every rank starts from rank 0's parameters and buffers."""
    if _grouped() and dist.get_world_size() > 1:
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)
