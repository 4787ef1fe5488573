#!/usr/bin/env bash
# One batched GPU session (docs/gpu-results.md): versions, the test suite on CUDA, the fuzz
# campaigns on the cuda backend (controlled and free), the fuzz benchmark, a torch.cuda zeroer
# through a factory, and a simulator trace replayed on the GPU. Logs go to $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { echo; echo "=== $1 ($(date +%T))"; }
step versions
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, triton, hypothesis; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "hypothesis", hypothesis.__version__)'; } 2>&1 | tee "$OUT/versions.txt"
step "tests on CUDA"
timeout 240 python3 -m pytest tests -q -x -p no:cacheprovider -n 4 2>&1 | tail -25 | tee "$OUT/tests.txt"
step "fuzz campaigns, cuda backend"
timeout 300 python3 -m pytest fuzz -q -p no:cacheprovider -n 4 --backend cuda --fuzz-profile ci \
  --repro-dir "$OUT/failures" --fuzz-summary "$OUT/fuzz-summary.json" 2>&1 | tail -40 | tee "$OUT/fuzz.txt"
step "torch.cuda zeroers through a factory (free-running)"
for f in make_single_buffer make_per_call; do
  timeout 120 python3 -m pytest fuzz -q -p no:cacheprovider --backend cuda --cuda-mode free \
    --zeroer "examples/torch_cuda_zeroer.py:$f" -k "tiny and shard0" --repro-dir "$OUT/ext-failures" \
    --fuzz-summary "$OUT/ext-$f.json" > "$OUT/ext-$f.log" 2>&1
  echo "$f exit=$?"; tail -4 "$OUT/ext-$f.log"
done 2>&1 | tee "$OUT/external.txt"
step "simulator traces replayed on CUDA (controlled), 20 repeats"
python3 -m pytest fuzz -q -p no:cacheprovider --backend sim -k "tiny-sim-k-torch-shard0 and (single_buffer or ring)" \
  --repro-dir sim-traces --fuzz-summary /tmp/sim-summary.json > /dev/null 2>&1
for t in sim-traces/*.json; do
  timeout 120 python3 -m repro replay "$t" --backend cuda --mode controlled --repeat 20 | tail -1
  timeout 120 python3 -m repro replay "$t" --backend sim | tail -1
done 2>&1 | tee "$OUT/replay.txt"
step "fuzz benchmark on CUDA"
timeout 200 python3 -m fuzz.bench --backend cuda --mode controlled --seeds 5 --json "$OUT/bench-cuda.json" 2>&1 | tail -25 | tee "$OUT/bench.txt"
step done
