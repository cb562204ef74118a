#!/usr/bin/env bash
# One runner for the GPU machine: `bash benchmarks/gpu/run.sh SUITE` from the repository root,
# with the pure-Python wheels carried in .whl/ (bash ../shared/offline-wheels.sh fills it).
# Logs and tables go to $OUT (./gpu_out elsewhere).
#   tests      every GPU test (1 GPU: single-GPU ones; 2 GPUs: EP and training ones too) + the CPU
#              tests of the step gate, profiler and checkpoints on this machine's torch
set -uo pipefail
source benchmarks/gpu/lib.sh
suite=${1:?usage: run.sh SUITE (tests)}
case $suite in
  tests)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt"
    python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpus.txt"
    timeout ${TMO:-540} python3 -m pytest tests/test_gpu.py tests/test_gpu_ep.py tests/test_gpu_train.py \
      tests/test_profiling.py tests/test_checkpoint_verify.py tests/test_reliability.py -k "not run_stops and not nonfinite_weights and not fresh_run and not bad" \
      -p no:warnings -q -rfEs --durations=15 --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
    for f in /tmp/pytest-of-*/pytest-*/test_nvlink_capacity_grows*/grow/metrics.jsonl; do
      [ -f "$f" ] && python3 -c "
import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]
print('grow-to-fit replayed steps', [x['step'] for x in r if x.get('moe/replayed')])" "$f" | tee -a "$OUT/gpu_tests.log"
    done ;;
  *) echo "unknown suite $suite" >&2; exit 2 ;;
esac
