#!/usr/bin/env bash
# The offload fuzzer's GPU evidence (docs/fuzz-your-offloader.md, "Detection"): one command, under
# 8 minutes on an H200, from the repository root:
#   bash fuzz/bench/offload-evidence.sh OUTDIR
# 1. the GPU cases of tests/test_offload.py (each racy example's shortest program forced in the
#    controlled mode, its race-free twin clean);
# 2. the detection table: every example under fuzz (controlled and free-running), the stress loop
#    and PyTorch's CUDA sanitizer, 2 seeds, 60 s each at most;
# 3. the race-free examples free-running until 20,000 steps each;
# 4. the GPU cases of the engines' idioms under the fuzzer's interception (timing events, priorities,
#    raw stream handles, copy threads, cuda-bindings imported: tests/test_engine_idioms.py,
#    tests/test_helper_threads.py, tests/test_sim_conformance.py).
# Each stage has its own time limit, so the whole ends within 8 minutes whatever happens: at its limit
# a stage gets SIGTERM and, if anything of it is still there 10 s later, SIGKILL (a stage cut off says
# "exit 124" in its log, one killed "exit 137"). The results go into OUTDIR/offload-evidence.tar.gz.
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
timeout -k 10 "$(lim 60)" $py -m pytest tests/test_offload.py -k "cuda" -q -p no:cacheprovider --tb=short -rfE \
  > "$out/gpu-tests.txt" 2>&1; echo "exit $?" >> "$out/gpu-tests.txt"
# The GPU methods only: fuzz-sim is the CPU's evidence (CI and docs/fuzz-your-offloader.md measure it).
timeout -k 10 "$(lim 240)" $py -m fuzz.bench.offload --backend cuda --methods fuzz-controlled,fuzz-free,stress,torch-sanitizer \
  --seeds 2 --budget 60 -j "${WORKERS:-8}" \
  --json "$out/$card-offload-$month.json" > "$out/detect.txt" 2> "$out/detect-progress.txt"
echo "exit $?" >> "$out/detect.txt"
timeout -k 10 "$(lim 120)" $py -m fuzz.bench.offload --backend cuda --steps-clean 20000 --budget 30 -j 4 \
  --json "$out/$card-offload-soak-$month.json" > "$out/soak.txt" 2> "$out/soak-progress.txt"
echo "exit $?" >> "$out/soak.txt"
timeout -k 10 "$(lim 45)" $py -m pytest tests/test_engine_idioms.py tests/test_helper_threads.py tests/test_sim_conformance.py \
  -k "cuda" -q -p no:cacheprovider --tb=short -rfE > "$out/idiom-tests.txt" 2>&1; echo "exit $?" >> "$out/idiom-tests.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
tar -czf "$out/offload-evidence.tar.gz" -C "$out" --exclude offload-evidence.tar.gz .
