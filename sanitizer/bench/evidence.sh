#!/usr/bin/env bash
# The sanitizer's GPU evidence (docs/sanitizer.md, "Results"): two commands, each under 8 minutes on
# an H200, from the repository root:
#   bash sanitizer/bench/evidence.sh OUTDIR          # the table, the overhead, the per-op profile, the GPU tests
#   bash sanitizer/bench/evidence.sh OUTDIR suite    # this project's own test suite under --kvz-sanitize
#   bash sanitizer/bench/evidence.sh OUTDIR engines  # the engine-style unit tests, the engines' idioms, their
#                                                    # real shapes under PyTorch's sanitizer and on CUDA
# (WORKERS and SUITE_SECONDS change the suite's xdist workers, 12, and its time limit, 470 s; WORKERS
# and JOBS also the other stages' pytest workers and benchmark jobs; OVERHEAD_ROUNDS the overhead
# table's rounds, 3.)
# Part one: every benchmark program (the engine-like programs, the corpus of the engines' own races
# with its --sleep ground truth, the campaigns' zeroers) under PyTorch's sanitizer and ours, judged by
# kind and both lines; the overhead ratios; the GPU tests of the observer's race logic and of force
# mode. Part two: the whole suite, sanitized, with what cannot be followed (kvzero's own gated harness)
# as notes. Each stage gets SIGTERM at its limit and SIGKILL 10 s later if anything of it is left.
set -u
out=${1:?give an output directory}
mkdir -p "$out"
py=${PYTHON:-python3}
month=$(date +%Y-%m)
# The data files are named after the card that made them (h100, h200, ...), as docs/results.md cites them.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[a-z]+[0-9]{2,3}[a-z]*' | head -1 | tr '[:upper:]' '[:lower:]')
card=${card:-gpu}
# STAGE_SCALE (default 1) scales every stage's time limit: the GPU check (.gpu/check) runs the stages
# beside each other in less time.
lim() { awk -v s="${STAGE_SCALE:-1}" -v n="$1" 'BEGIN { printf "%d", n * s }'; }
export PYTHONUNBUFFERED=1
if [ "${2:-}" = engines ]; then
  # tests/engine_style/ under the sanitizer observing the GPU: race-free (0 races) and with the
  # planted race (reported); then the idioms' GPU cases in both tools.
  for planted in 0 1; do
    ENGINE_STYLE_PLANTED_RACE=$planted timeout -k 10 "$(lim 90)" $py -m pytest tests/engine_style -q -p no:cacheprovider -p no:randomly \
      --kvz-sanitize > "$out/engine-style-planted-$planted.txt" 2>&1
    echo "exit $?" >> "$out/engine-style-planted-$planted.txt"
  done
  timeout -k 10 "$(lim 90)" $py -m pytest tests/test_engine_idioms.py -k "cuda" -q -p no:cacheprovider --tb=short -rfE \
    > "$out/idiom-tests.txt" 2>&1; echo "exit $?" >> "$out/idiom-tests.txt"
  # docs/engine-shapes.md: PyTorch's sanitizer on each real-shape program, and their GPU tests
  # (the table-kernel handler fuzzed on CUDA, the driver copies, the custom ops' references).
  timeout -k 10 "$(lim 90)" $py -m sanitizer.bench.engine_shapes --tools torch -j "${JOBS:-6}" --json "$out/$card-engine-shapes-torch-$month.json" \
    > "$out/engine-shapes-torch.txt" 2>&1; echo "exit $?" >> "$out/engine-shapes-torch.txt"
  timeout -k 10 "$(lim 120)" $py -m pytest tests/test_table_kernels.py tests/test_driver_copies.py tests/test_custom_ops.py \
    tests/test_interpreter_gaps.py -n "${WORKERS:-8}" -q -p no:cacheprovider -p no:randomly --tb=short -rfE \
    > "$out/engine-shapes-gpu-tests.txt" 2>&1; echo "exit $?" >> "$out/engine-shapes-gpu-tests.txt"
  exit 0
fi
if [ "${2:-}" = suite ]; then
  timeout -k 10 "$(lim "${SUITE_SECONDS:-470}")" $py -m pytest tests -n "${WORKERS:-12}" -q -p no:cacheprovider --tb=line -rf --durations=30 \
    --kvz-sanitize --kvz-sanitize-partial \
    -W ignore::pytest.PytestWarning > "$out/own-suite-full.txt" 2>&1
  echo "exit $?" >> "$out/own-suite-full.txt"
  grep -v "^\.\|^s\|PytestBenchmarkWarning\|warner(\|cannot follow kvzero" "$out/own-suite-full.txt" \
    | tail -200 > "$out/own-suite.txt"
  exit 0
fi
timeout -k 10 "$(lim 200)" $py -m sanitizer.bench.compare -j "${JOBS:-16}" --steps 8 --json "$out/$card-sanitizer-compare-$month.json" \
  > "$out/compare.txt" 2>&1; echo "exit $?" >> "$out/compare.txt"
timeout -k 10 "$(lim 200)" $py -m sanitizer.bench.overhead --rounds "${OVERHEAD_ROUNDS:-3}" --json "$out/$card-sanitizer-overhead-$month.json" \
  > "$out/overhead.txt" 2>&1; echo "exit $?" >> "$out/overhead.txt"
timeout -k 10 "$(lim 90)" $py -m sanitizer.bench.op_cost --steps 2000 --rounds 3 --json "$out/$card-sanitizer-op-cost-$month.json" \
  --profile "$out/op-cost-profile.txt" > "$out/op-cost.txt" 2>&1; echo "exit $?" >> "$out/op-cost.txt"
timeout -k 10 "$(lim 110)" $py -m pytest tests/test_sanitizer_gpu.py tests/test_sanitizer_observer.py -k "not each_program" \
  -q -p no:cacheprovider -n "${WORKERS:-6}" --tb=short -rfE > "$out/gpu-tests.txt" 2>&1; echo "exit $?" >> "$out/gpu-tests.txt"
