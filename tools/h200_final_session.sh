#!/usr/bin/env bash
# The H200 session for the kernel benchmark, the detection benchmark and the soak
# (docs/performance.md, docs/detection.md, docs/gpu-results.md). Two parts, each one device call
# of at most 600 s: `part1` (tests, fuzz.bench.kernel, fuzz.bench.detect side by side) and `part2` (soak of
# the race-free designs, `pytest fuzz -n 2` on one GPU, the torch.cuda example). Only a few files
# go under $OUT; traces of findings go to /tmp.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { echo; echo "=== $1 ($(date +%T))"; }
part=${1:-part1}
{
step "versions ($part)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import sys, torch, triton, hypothesis; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "hypothesis", hypothesis.__version__)'
if [ "$part" = part1 ]; then
  step "tests (CUDA ones run here)"
  timeout 150 python3 -m pytest tests -q -p no:cacheprovider -n 8 -W ignore 2>&1 | tail -15
  step "zeroer benchmark"
  timeout 220 python3 -m fuzz.bench.kernel --json "$OUT/zeroer-bench.json" --max-seconds 200 2>&1 | tail -70
  step "detection benchmark, side by side: fuzz (controlled), stress, sanitizer, handwritten"
  timeout 190 python3 -m fuzz.bench.detect --backend cuda --seeds 3 --budget 10 -j 8 \
    --json "$OUT/detect-cuda.json" --png "$OUT/detect-cuda.png" --repro-dir /tmp/detect-failures 2>&1 | tail -60
elif [ "$part" = part2 ]; then
  ENTRIES=$(python3 -c 'from zeroer.registry import ZOO, RACE_FREE; print(",".join(n for n in sorted(ZOO + RACE_FREE) if n != "zoo.int32_offset_4gib"))')
  step "detection benchmark, side by side, every entry but the 5 GiB one"
  timeout 230 python3 -m fuzz.bench.detect --backend cuda --seeds 3 --budget 8 -j 10 --entries "$ENTRIES" \
    --json "$OUT/detect-cuda.json" --png "$OUT/detect-cuda.png" --repro-dir /tmp/detect-failures 2>&1 | grep -v "^\[" | tail -45
  step "detection benchmark: zoo.int32_offset_4gib alone (a 5 GiB cache per example)"
  timeout 80 python3 -m fuzz.bench.detect --backend cuda --seeds 3 --budget 10 -j 1 --entries zoo.int32_offset_4gib --methods fuzz,stress,handwritten \
    --json "$OUT/detect-cuda-4gib.json" --repro-dir /tmp/detect-failures 2>&1 | grep -v "^\[" | tail -12
  step "soak: race-free implementations, 200,000 steps on the cuda backend"
  timeout 120 python3 -m fuzz.bench.detect --backend cuda --steps-clean 200000 -j 10 --json "$OUT/soak-cuda.json" \
    --repro-dir /tmp/soak-failures 2>&1 | grep -v "^\[" | tail -15
  step "pytest fuzz -n 2 on one GPU (both workers on device 0)"
  timeout 100 python3 -m pytest fuzz -q -p no:cacheprovider -n 2 -W ignore --backend cuda --fuzz-profile ci -k "tiny and not fault and shard0" \
    --repro-dir /tmp/n2-failures --fuzz-summary /tmp/fuzz-n2-summary.json 2>&1 | tail -5
fi
step done
} 2>&1 | tee "$OUT/session-$part.log"
