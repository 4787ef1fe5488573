#!/usr/bin/env bash
# The H200 session for the direct designs and the kernel's new default (docs/performance.md,
# docs/gpu-results.md): the CUDA tests, the direct designs' fuzz campaigns, every cuda campaign
# again (the kernel changed under them), and the benchmark. Two device calls of at most 600 s:
# `part1` (tests, benchmark) and `part2` (fuzz campaigns).
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
step "tests of the direct designs and the kernel"
timeout 120 python3 -m pytest tests/test_direct.py tests/test_kernel.py -q -p no:cacheprovider -W ignore 2>&1 | tail -15
step "zeroer benchmark"
timeout 200 python3 -m fuzz.bench.kernel --json "$OUT/zeroer-bench.json" --max-seconds 180 2>&1 | tail -75
step "the whole test suite"
timeout 200 python3 -m pytest tests -q -p no:cacheprovider -n 8 -W ignore 2>&1 | tail -12
else
step "fuzz: every cuda campaign, the direct designs' free-running ones included"
timeout 400 python3 -m pytest fuzz -q -p no:cacheprovider -n 4 -W ignore --backend cuda \
  --repro-dir "$OUT/failures" --fuzz-summary "$OUT/fuzz-cuda-summary.json" 2>&1 | tail -15
fi
step done
} 2>&1 | tee "$OUT/session4-$part.log"
