#!/usr/bin/env bash
# The default command's speed targets, each in one device call (at most ~9 minutes each):
#
#   benchmarks/issue17_call.sh            the plain command 5 times against the conventional
#                                         script (each epoch's seconds kept), the start-up floor
#                                         before each and after the last (the exit target), and
#                                         alternating with three time-to-first-step runs,
#                                         ResNet-18 weak scaling at 1 and all GPUs twice
#   benchmarks/issue17_call.sh tests      the GPU tests (7-8 minutes on 4 GPUs), then, if time
#                                         is left, first_use.py on all GPUs without and with the
#                                         trainer's CUDA warm-up
#   benchmarks/issue17_call.sh accuracy   both scripts' accuracy over 12 seeds, 3 runs a GPU
#
# WANT=H100 (or any text of the card's name): stop at once, exit 3, on other cards; a kind asked
# for can come as another card, and a whole call measured on the wrong one costs minutes.
#
# BASE=DIR (a directory holding another revision's hpc_ddp/, carried in an ignored folder, e.g.
# git archive REV hpc_ddp | tar -x -C .gpu/base): the plain runs alternate with that revision's.
#
# The floor (interpreter, import torch, one forked rank per GPU, NCCL, one all-reduce) is a
# measuring stick kept outside the project: copy it to .gpu/i17/startup_floor.py (git-ignored)
# and carry .gpu/i17. Output under $OUT: cards.txt (GPUs, cores, CPU, seconds per part),
# floor.txt, tables.md (each suite's rows), json.tgz (bench.json files and logs).
set -u
if [ -n "${WANT:-}" ] && ! nvidia-smi -L | grep -q -- "$WANT"; then
  nvidia-smi -L | head -1; echo "not $WANT: stopping"; exit 3
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
O=${OUT:-/tmp/out}; mkdir -p "$O"
T=$SECONDS
NG=$(nvidia-smi -L | wc -l)
W=/tmp/hpc-ddp-bench
nvidia-smi -L > "$O/cards.txt"; nproc >> "$O/cards.txt"; lscpu | grep "Model name" >> "$O/cards.txt"
log() { echo "$1: $((SECONDS-T)) s" >> "$O/cards.txt"; }

case "${1:-}" in
  tests)
    # The GPU tests first: 25 took 6 min 23 s on one 4 x H200 machine and 21 needed more than
    # 6 min 50 s on another, so they get the call's time; first_use.py only if time is left.
    timeout 560 python3 -m pytest -q -rs -p no:cacheprovider --timeout 200 --durations=0 \
      tests/test_gpu.py tests/test_gpu_plugins.py tests/test_gpu_eval_graph.py > "$O/tests.txt" 2>&1
    log tests
    port=29640
    for w in "" --warm-kernels; do
      ((SECONDS - T > 540)) && break
      port=$((port + 1))
      echo "## first_use.py --nproc $NG $w" >> "$O/first_use_n.txt"
      timeout 30 python3 benchmarks/first_use.py --nproc "$NG" $w --port $port \
        >> "$O/first_use_n.txt" 2>&1
    done
    log first_use; cat "$O/cards.txt"
    grep -E "^##|x $NG:|step 1 |first use" "$O/first_use_n.txt"; grep -E "passed|failed" "$O/tests.txt"
    exit 0 ;;
  accuracy)
    # 12 seeds, three runs a GPU (4 seeds took ~3 minutes one a GPU on 4 x H200)
    timeout 570 python3 benchmarks/accuracy.py --seeds 0,1,2,3,4,5,6,7,8,9,10,11 --per-gpu 3 \
      --out /tmp/acc > "$O/acc.log" 2>&1
    log accuracy; cp /tmp/acc/accuracy.json "$O/" 2>/dev/null
    cat "$O/cards.txt"; tail -10 "$O/acc.log"
    exit 0 ;;
esac

floor() { s=$(date +%s.%N); python3 .gpu/i17/startup_floor.py "$NG" "$1" | sed "s/\$/ shell_start=$s/"; }
if [ -n "${BASE:-}" ]; then  # another revision's hpc_ddp/ in $BASE: its plain runs alternate
  plain=(--plain-base "$BASE" --budget-s 300); limit=305
else
  plain=(--budget-s 220); limit=225
fi
# A floor before each plain run and after the last (bench.py --floor): each run's exit target
# takes the two beside it.
timeout $limit python3 benchmarks/bench.py --gpus "$NG" --suites plain --repeats 5 "${plain[@]}" \
  --floor .gpu/i17/startup_floor.py --work $W --out /tmp/plain > /tmp/plain.log 2>&1
log plain
for r in 1 2 3; do
  timeout 40 python3 benchmarks/bench.py --gpus "$NG" --suites ttfs --repeats 1 --budget-s 38 \
    --work $W --out /tmp/ttfs$r > /tmp/ttfs$r.log 2>&1
  floor $((29619+r)) >> "$O/floor.txt" 2>&1
done
log ttfs
timeout $((560-(SECONDS-T))) python3 benchmarks/bench.py --gpus 1,"$NG" --suites weak --repeats 2 \
  --budget-s $((550-(SECONDS-T))) --work $W --out /tmp/weak > /tmp/weak.log 2>&1
log weak
(cd /tmp && tar czf "$O/json.tgz" ./*/bench.json ./*.log)
for s in plain ttfs1 ttfs2 ttfs3 weak; do
  echo "## $s"; grep -E "^\|" /tmp/$s/tables.md | grep -v "^|---"
done > "$O/tables.md" 2>/dev/null
cat "$O/cards.txt"; grep FLOOR "$O/floor.txt"
grep -E "^## |conventional DDP script \| $NG \| [0-9]|nproc-per-node|^\| [14] \| [0-9]|ttfs_lenet|\| (yes|no) \|$" \
  "$O/tables.md" | head -40
