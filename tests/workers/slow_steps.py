"""Run a training script with every optimizer step slowed down, for the preemption tests: a
signal sent when the script has printed its first epoch then lands mid-run, at whatever step
the timing gives. The script itself runs unchanged (runpy, as ``python SCRIPT ARGS``).

Usage: slow_steps.py SECONDS SCRIPT [ARGS...]
"""

import runpy
import sys
import time

import torch

delay, script = float(sys.argv[1]), sys.argv[2]
for cls in (torch.optim.SGD, torch.optim.Adam):
    step = cls.step

    def slow(self, *args, _step=step, **kwargs):
        time.sleep(delay)
        return _step(self, *args, **kwargs)

    cls.step = slow
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
