#!/usr/bin/env bash
# One device call for the default command's speed: the start-up floor beside the default command's
# time to first step, the headline against the conventional script, a finished run's command
# again, and the GPU tests of the defaults. The floor script (interpreter, import torch, 4 forked
# ranks, NCCL, one all-reduce) is a measuring stick kept outside the project: copy it to
# .gpu/i17/startup_floor.py (git-ignored) and carry .gpu/i17.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi -L > $O/cards.txt; python3 -c 'import torch;print(torch.__version__, torch.cuda.nccl.version())' >> $O/cards.txt
T=$SECONDS
# 1. the floor, 3 runs, before and after the ttfs suite (same machine, same call)
for i in 1 2; do python3 .gpu/i17/startup_floor.py 4 $((29611+i)); done > $O/floor.txt 2>&1
# 2. time to first step of the default command (probe), 3 repeats, + eager prefetch A/B
timeout 150 python3 benchmarks/bench.py --gpus 4 --suites ttfs --repeats 3 --ttfs-eager --budget-s 110 --out $O/ttfs > $O/ttfs.log 2>&1
python3 .gpu/i17/startup_floor.py 4 29619 >> $O/floor.txt 2>&1
echo "after ttfs: $((SECONDS-T)) s"
# 3. the headline: conventional DDP script vs default command vs --cuda-graphs, 4 GPUs
timeout 220 python3 benchmarks/bench.py --gpus 4 --suites ref --lean --budget-s 190 --out $O/ref > $O/ref.log 2>&1
echo "after ref: $((SECONDS-T)) s"
# 4. a finished run's command again (was 8.3 s on 4 GPUs)
A="--nproc-per-node 4 --synthetic --dataset cifar100 --data-dir /tmp/f/d --run-dir /tmp/f/r --epochs 1 --log-every 100000"
(time python3 -m hpc_ddp.train $A) > $O/finished.txt 2>&1
for i in 1 2 3 4 5; do /usr/bin/time -f "rerun %e s" python3 -m hpc_ddp.train $A >> $O/finished.txt 2>&1; done
echo "after finished: $((SECONDS-T)) s"
# 5. GPU tests of the new defaults
timeout $((560-(SECONDS-T))) python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py --timeout 150 -k "default or graph or cli or resume or syncbn" > $O/tests.txt 2>&1
echo "after tests: $((SECONDS-T)) s"
tail -3 $O/floor.txt; grep -E "^\|" $O/ttfs/tables.md 2>/dev/null | head -20; grep -E "^\|" $O/ref/tables.md 2>/dev/null | head -20; grep rerun $O/finished.txt; tail -3 $O/tests.txt
