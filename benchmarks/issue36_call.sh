#!/usr/bin/env bash
# ResNet-18 on data in memory and on an image folder from disk, side by side in ONE device call
# (about 7-9 minutes on a 2-GPU machine): the bare loop (1 GPU), `hpc-ddp train` and
# Lightning's Trainer (DDP, bf16-mixed, 8 DataLoader workers, the same crop+flip) on 1 and 2
# GPUs, on CIFAR-100-shaped files (50,000 / 10,000) and on a synthetic image folder (100
# classes x 100 PNGs at 64 px, 20 a class for the test split), 4 epochs each, batch 256 a GPU.
#
#   OUT=OUT benchmarks/issue36_call.sh          the table above
#   OUT=OUT benchmarks/issue36_call.sh 224      the image folder at 224 px (100 x 30 PNGs)
#   OUT=OUT benchmarks/issue36_call.sh tests    the image folder's GPU test (2 GPUs, ~1 minute)
#
# Lightning comes from the machine's image, or from wheels carried in .whl/ (installed into
# /tmp/site first; see benchmarks/README.md). Output under $OUT: cards.txt, one JSON record per
# run, logs, summary.md (steady samples/s and command-to-exit per run, ours / Lightning ratios).
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
  timeout 500 python3 -m pytest -q -rs -p no:cacheprovider --timeout 400 \
    tests/test_gpu_image_folder.py > "$O/tests.txt" 2>&1
  cat "$O/cards.txt"; tail -5 "$O/tests.txt"; exit 0
fi
SIZE=${1:-64}
PER_CLASS=100; [ "$SIZE" -gt 64 ] && PER_CLASS=30
# The data, written once per machine (a warm machine keeps /tmp): the CIFAR-100 files by the
# first cifar run (lightning_bench.py, before its clock starts), the image folder here.
python3 -m hpc_ddp.train.image_synthetic $W/folder$SIZE --classes 100 --per-class $PER_CLASS \
  --test-per-class 20 --size "$SIZE" --processes "$(nproc)"
log data

bench() {  # trainer data gpus [extra]
  local root=$W/data; [ "$2" = folder ] && root=$W/folder$SIZE
  timeout 110 python3 benchmarks/lightning_bench.py --trainer "$1" --data "$2" --root "$root" \
    --gpus "$3" --size "$SIZE" --work $W/work --timeout 100 --json "$O/runs/$1_$2_$3gpu.json" \
    > "$O/runs/$1_$2_$3gpu.log" 2>&1
  log "$1 $2 $3gpu"
}
bench bare cifar 1
bench bare folder 1
NG=$(nvidia-smi -L | wc -l)
for n in 1 2; do
  [ "$n" -gt "$NG" ] && continue
  for d in cifar folder; do
    for t in ours lightning; do
      ((SECONDS - T > 470)) && break 3
      bench $t $d $n
    done
  done
done
python3 benchmarks/lightning_bench.py --summary "$O/runs" > /dev/null
cp "$O/runs/summary.md" "$O/summary.md"
cat "$O/cards.txt" "$O/summary.md"
exit 0
