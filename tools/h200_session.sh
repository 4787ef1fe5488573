#!/usr/bin/env bash
# One batched GPU session (docs/gpu-results.md): versions, the CUDA tests, the fuzz campaigns on
# the cuda backend (controlled and free), simulator traces replayed on the GPU, and the fuzz
# benchmark. At most 8 files under $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { echo; echo "=== $1 ($(date +%T))"; }
{
step versions
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import sys, torch, triton, hypothesis; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "hypothesis", hypothesis.__version__)'
step "tests (CUDA ones run here)"
timeout 150 python3 -m pytest tests -q -p no:cacheprovider -n 4 -W ignore 2>&1 | tail -15
step "fuzz campaigns, cuda backend, geometry tiny"
timeout 170 python3 -m pytest fuzz -q -p no:cacheprovider -n 4 -W ignore --backend cuda --fuzz-profile ci -k tiny \
  --repro-dir "$OUT/failures" --fuzz-summary "$OUT/fuzz-summary.json" 2>&1 | tail -22
step "simulator traces replayed on CUDA (controlled), 20 repeats each"
python3 -m pytest fuzz -q -p no:cacheprovider --backend sim -k "tiny-sim-k-torch-shard0 and (single_buffer or ring)" \
  --repro-dir sim-traces --fuzz-summary /tmp/sim-summary.json > /dev/null 2>&1
for t in sim-traces/*.json; do
  echo "$t"; timeout 60 python3 -m repro replay "$t" --backend cuda --mode controlled --repeat 20 | tail -1
done
step "fuzz benchmark on CUDA (controlled)"
timeout 100 python3 -m fuzz.bench --backend cuda --mode controlled --seeds 5 --json "$OUT/bench-cuda.json" 2>&1 | tail -22
step done
} 2>&1 | tee "$OUT/session.log"
