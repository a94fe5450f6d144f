"""The trainer's speed machinery, behind the questions the trainer asks it (choice.py).

The default loop (hpc_ddp/train/trainer.py, state.py) is a plain DDP loop; what makes it fast
where that pays is chosen here, in one place, automatically:

- "make me a step": :func:`plan_step` decides once per run whether the step is captured as a
  CUDA graph (cuda_graphs.py: the public ``hpc_ddp.CapturedStep`` with the trainer's loss,
  and its evaluation graphs, eval_graph.py) and how an eager step averages gradients (sync.py:
  DDP with lighter settings, each gradient's own all-reduce on Gloo, tensor_average.py, or
  nothing); the resulting :class:`StepPlan` gives the model and optimizer their layout and kernel
  (``StepPlan.speed_up``: the public ``hpc_ddp.speed_up``, channels_last and the fused optimizer
  on GPUs), wraps the model and builds the step runner, and has the data hand its batches in
  the model's memory format (``StepPlan.feed``);
- "where does the data live": a dataset asks :func:`gpu_data.choose` whether its arrays go to
  the GPU once (gpu_data.py, read through the array cache, array_cache.py) or through a
  DataLoader; an image folder asks :func:`gpu_folder.decode_if_held` (the same answer,
  ``gpu_data.resident``, agreed by the ranks) whether it is decoded once and held there;
- the start: :class:`StartUp` pays CUDA's one-time costs (kernel_warmup.py) and imports
  torch._dynamo (prefetch.py) on threads while the process group comes up;
- step-rate advice (step_rate.py): :class:`LatencyAdvice` says when the GPU waits for the host.

The trainer asks only choice.py's names; the other modules are the machinery's own.
"""
