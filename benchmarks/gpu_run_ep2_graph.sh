#!/usr/bin/env bash
# v2lite_1b EP=2 nvlink graphed at capacity 1.5 (overflows mid-run → exact replays between graph
# replays), the configuration that crashed before the pre-replay synchronize; tokens/s vs torchtitan row.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/trainer_throughput.py --out "$OUT" --nproc 2 --config train_configs/v2lite_1b_gpu.toml \
  --steps 60 --label _ep2_graph_rerun --runs ours_graph \
  --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5" 2>&1 | tail -4
python3 -c "
import json
for l in open('/tmp/moe_echo_throughput/ours_graph/metrics.jsonl'):
    r=json.loads(l); print(r['step'], round(r['loss'],4), r.get('moe/overflow_assignments'), r.get('moe/replayed_steps'))" | tail -5
grep -E "cuda graph|misaligned" /tmp/moe_echo_throughput/ours_graph.log | head -5
