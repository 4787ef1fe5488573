#!/usr/bin/env bash
# One batched GPU session for the fuzzer and the repro cases (docs/gpu-results.md): versions,
# where the time of a cuda example goes, the fuzz benchmark in both cuda modes, the curated repro
# scripts 20 times each, and every fuzz campaign on the cuda backend. At most 8 files under $OUT.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { echo; echo "=== $1 ($(date +%T))"; }
{
step versions
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import sys, torch, triton, hypothesis; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "hypothesis", hypothesis.__version__)'
step "per-op cost (tools/profile_cuda.py)"
timeout 60 python3 tools/profile_cuda.py "$OUT/profile" 2>&1 | tail -25
step "curated repro scripts, 20 repeats each"
for script in repro/cases/single_buffer_pre_48085.py repro/cases/ring_overrun.py; do
  for mode in controlled free; do
    echo "$script --backend cuda --mode $mode --repeat 20"; timeout 60 python3 "$script" --backend cuda --mode $mode --repeat 20 | tail -1
  done
  for z in per_call event_ring reference; do
    echo "$script --backend cuda --zeroer $z --repeat 20"; timeout 60 python3 "$script" --backend cuda --zeroer $z --repeat 20 | tail -1
  done
done
step "fuzz benchmark on CUDA, controlled, 5 seeds"
timeout 150 python3 -m fuzz.bench.speed --backend cuda --mode controlled --seeds 5 --json "$OUT/bench-cuda-controlled.json" 2>&1 | tail -16
step "fuzz benchmark on CUDA, free, 5 seeds"
timeout 100 python3 -m fuzz.bench.speed --backend cuda --mode free --seeds 5 --json "$OUT/bench-cuda-free.json" 2>&1 | tail -16
step "every fuzz campaign on the cuda backend, ci profile, 4 workers"
timeout 170 python3 -m pytest fuzz -q -p no:cacheprovider -n 4 -W ignore --backend cuda --fuzz-profile ci \
  --repro-dir "$OUT/failures" --fuzz-summary "$OUT/fuzz-summary.json" 2>&1 | tail -30
step done
} 2>&1 | tee "$OUT/session.log"
