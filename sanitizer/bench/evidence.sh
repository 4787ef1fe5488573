#!/usr/bin/env bash
# The sanitizer's GPU evidence (docs/sanitizer.md, "Results"), one command, under 8 minutes on an H200:
#   bash sanitizer/bench/evidence.sh OUTDIR
# 1. the benchmark table: the engine-like programs and the fuzz campaigns' vLLM-style zeroers under
#    PyTorch's sanitizer and ours (observe and force); 2. the overhead ratios; 3. the GPU tests the
#    table does not already run; 4. no false alarms: this project's own test suite under --kvz-sanitize.
set -u
out=${1:?give an output directory}
mkdir -p "$out"
py=${PYTHON:-python3}
month=$(date +%Y-%m)
timeout 120 $py -m sanitizer.bench.compare -j 10 --json "$out/h200-sanitizer-compare-$month.json" \
  > "$out/compare.txt" 2>&1; echo "exit $?" >> "$out/compare.txt"
timeout 130 $py -m sanitizer.bench.overhead --rounds 2 --json "$out/h200-sanitizer-overhead-$month.json" \
  > "$out/overhead.txt" 2>&1; echo "exit $?" >> "$out/overhead.txt"
timeout 60 $py -m pytest tests/test_sanitizer_gpu.py -q -p no:cacheprovider -n 4 -k "not each_program" \
  > "$out/gpu-tests.txt" 2>&1; echo "exit $?" >> "$out/gpu-tests.txt"
# The whole suite under the sanitizer takes longer than this command may (over 7 minutes with 16
# workers on an H200, where 16 workers also run the GPU out of memory): here the tests that run the
# most CUDA work. The whole suite: pytest tests --kvz-sanitize --kvz-sanitize-partial -n 8
timeout 170 $py -m pytest tests/test_examples.py tests/test_interrupts.py tests/test_sanitizer_cli.py \
  tests/test_zeroer_bench.py tests/test_intercept.py -k "cuda or single_buffer or pytest_plugin or twin or unchecked" \
  -q -p no:cacheprovider -n 8 --tb=line -rf --kvz-sanitize --kvz-sanitize-partial -W ignore::pytest.PytestWarning \
  > "$out/own-suite-full.txt" 2>&1
echo "exit $?" >> "$out/own-suite-full.txt"
grep -v "^\.\|^s\|PytestBenchmarkWarning\|warner(\|cannot follow kvzero" "$out/own-suite-full.txt" | tail -150 > "$out/own-suite.txt"
