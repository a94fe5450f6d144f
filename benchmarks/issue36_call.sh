#!/usr/bin/env bash
# The speed targets side by side in ONE device call on a 2- or 4-GPU machine (8-10 minutes): the
# bare loop (1 GPU, every variant), `hpc-ddp train` and Lightning's Trainer (DDP, bf16-mixed,
# 8 DataLoader workers, the same crop+flip) on 1 and 2 GPUs, 4 epochs, batch 256 a GPU, for
#   - the built-in ResNet-18 on CIFAR-100-shaped files (50,000 / 10,000) held in memory,
#   - a plug-in ResNet-50 (benchmarks/bench_models.py, torchvision's) on an image folder of
#     PNGs written by hpc_ddp.train.image_synthetic (100 classes x 500 at 64 px: epochs of about
#     100 steps on 2 GPUs, so an epoch's start is not most of it),
#   - and, with `224` as argument, the ResNet-50 on a 224 px folder (100 x 30) instead.
# `ours` also runs on 4 GPUs where the machine has them (weak scaling at 4).
#
#   OUT=OUT benchmarks/issue36_call.sh          the tables of benchmarks/README.md
#   OUT=OUT benchmarks/issue36_call.sh 224      the 224 px folder
#   OUT=OUT benchmarks/issue36_call.sh tests    the GPU tests of the fast step and the data paths
#
# Lightning comes from the machine's image, or from wheels carried in .whl/ (installed into
# /tmp/site first; see benchmarks/README.md). Output under $OUT: cards.txt, one JSON record and
# log per run in runs/, summary.md (steady samples/s, command-to-exit, the ratios).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
O=${OUT:-/tmp/out}; mkdir -p "$O/runs"
T=$SECONDS
W=/tmp/issue36
mkdir -p $W
nvidia-smi -L > "$O/cards.txt"; nproc >> "$O/cards.txt"; lscpu | grep "Model name" >> "$O/cards.txt"
python3 -c "import lightning, torch; print('lightning', lightning.__version__, 'torch', torch.__version__)" \
  >> "$O/cards.txt" 2>&1
log() { echo "$1: $((SECONDS-T)) s" >> "$O/cards.txt"; }

if [ "${1:-}" = tests ]; then
  timeout 560 python3 -m pytest -q -rs -p no:cacheprovider --timeout 300 tests/test_gpu_speed.py \
    tests/test_gpu_capture.py tests/test_gpu_image_folder.py > "$O/tests.txt" 2>&1
  cat "$O/cards.txt"; tail -5 "$O/tests.txt"; exit 0
fi
SIZE=${1:-64}
PER_CLASS=500; [ "$SIZE" -gt 64 ] && PER_CLASS=30
R50=benchmarks/bench_models.py:resnet50
python3 -m hpc_ddp.train.image_synthetic $W/folder$SIZE --classes 100 --per-class $PER_CLASS \
  --test-per-class 50 --size "$SIZE" --processes "$(nproc)" > /dev/null
log data

bench() {  # trainer data gpus model [tag]
  local root=$W/data; [ "$2" = folder ] && root=$W/folder$SIZE
  local name="$1_$2_$3gpu_$(basename "${4%%:*}" .py)${5:+_$5}"
  timeout 150 python3 benchmarks/lightning_bench.py --trainer "$1" --data "$2" --root "$root" \
    --gpus "$3" --size "$SIZE" --model "$4" --tag "${5:-}" --work $W/work --timeout 140 \
    --json "$O/runs/$name.json" > "$O/runs/$name.log" 2>&1
  log "$name"
}
NG=$(nvidia-smi -L | wc -l)
runs=()
[ "$SIZE" = 64 ] && runs+=("cifar resnet18")
runs+=("folder $R50")
for run in "${runs[@]}"; do
  set -- $run
  bench bare "$1" 1 "$2"
  for n in 1 2; do
    [ "$n" -gt "$NG" ] && continue
    bench ours "$1" "$n" "$2"
    bench lightning "$1" "$n" "$2"
    bench ours "$1" "$n" "$2" r2  # weak scaling is judged on the median of repeats
  done
  if [ "$NG" -ge 4 ]; then
    bench ours "$1" 4 "$2"
    bench ours "$1" 4 "$2" r2
  fi
done
python3 benchmarks/lightning_bench.py --summary "$O/runs" > /dev/null
cp "$O/runs/summary.md" "$O/summary.md"
cat "$O/cards.txt" "$O/summary.md"
exit 0
