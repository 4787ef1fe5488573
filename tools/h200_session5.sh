#!/usr/bin/env bash
# The fifth H200 session (issue 6). Parts, one device call each (at most 600 s):
#   hunt       the graph_ring campaign failure: its free-running campaigns on the nightly profile
#              (random seeds, full tracebacks), and what limits the kernel on scattered pages
#              (tools/h200_scatter_ceiling.py);
#   verify     after the fix: the CUDA tests, the guard's counter-check
#              (tools/h200_gc_capture_check.py), the benchmark, graph_ring's campaigns again;
#   campaigns  every cuda campaign on the default (quick) profile;
#   all        verify and campaigns in one call (HUNT_MINUTES sets the hunt's length).
# Traces of findings come back as one archive.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { echo; echo "=== $1 ($(date +%T))"; }
part=${1:-hunt}
MIN=${HUNT_MINUTES:-3}
hunt() {
  step "graph_ring free-running campaigns, nightly profile, $MIN minutes"
  timeout 400 python3 -m pytest fuzz -p no:cacheprovider -n 4 -W ignore --backend cuda -k "graph_ring and free" \
    --fuzz-minutes "$MIN" --repro-dir /tmp/hunt --fuzz-db /tmp/hunt-db --fuzz-summary "$OUT/hunt-summary.json" \
    --tb=long -rfE 2>&1 | tail -150
}
verify() {
  step "the whole test suite"
  timeout 200 python3 -m pytest tests -q -p no:cacheprovider -n 8 -W ignore -rfE --tb=short 2>&1 | tail -30
  step "the garbage-collector guard, switched off"
  timeout 60 python3 tools/h200_gc_capture_check.py 2>&1 | grep -v "^\[W" | tail -5
  step "zeroer benchmark"
  timeout 150 python3 -m fuzz.bench.kernel --json "$OUT/zeroer-bench.json" --max-seconds 120 2>&1 | tail -75
}
{
step "versions ($part)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import sys, torch, triton, hypothesis; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "hypothesis", hypothesis.__version__)'
if [ "$part" = hunt ]; then
  step "tests of the direct designs and the kernel"
  timeout 150 python3 -m pytest tests/test_direct.py tests/test_kernel.py -q -p no:cacheprovider -W ignore -rfE --tb=short 2>&1 | tail -30
  step "scattered pages: what limits the kernel"
  timeout 150 python3 tools/h200_scatter_ceiling.py "$OUT" 2>&1 | tail -40
  hunt
elif [ "$part" = verify ]; then
  verify
  hunt
elif [ "$part" = all ]; then
  verify
  step "every cuda campaign, quick profile"
  timeout 240 python3 -m pytest fuzz -q -p no:cacheprovider -n 4 -W ignore --backend cuda --tb=short -rfE \
    --repro-dir /tmp/hunt --fuzz-summary "$OUT/fuzz-cuda-summary.json" 2>&1 | tail -40
  hunt
else
  step "every cuda campaign, quick profile"
  timeout 560 python3 -m pytest fuzz -q -p no:cacheprovider -n 4 -W ignore --backend cuda --tb=short -rfE \
    --repro-dir /tmp/hunt --fuzz-summary "$OUT/fuzz-cuda-summary.json" 2>&1 | tail -80
fi
step "traces"
ls -R /tmp/hunt 2>/dev/null | head -40
[ -d /tmp/hunt ] && tar -czf "$OUT/hunt-traces.tgz" -C /tmp hunt
step done
} 2>&1 | tee "$OUT/session5-$part.log"
