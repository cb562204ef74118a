#!/usr/bin/env bash
# Repro attempt: v2lite_1b, EP=2 nvlink, graphed, capacity 1.0 (overflow early → exact replays),
# with CUDA_LAUNCH_BLOCKING=1 so a faulting kernel is named.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
r() { CUDA_LAUNCH_BLOCKING=${CLB:-1} timeout 150 torchrun --nproc_per_node 2 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml \
  --training.steps 40 --metrics.log_freq 1 --metrics.enable_tensorboard false --checkpoint.enable false \
  --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink --training.cuda_graph true \
  --job.dump_folder /tmp/m_$1 "${@:2}" > /tmp/m_$1.log 2>&1
  echo "== $1 rc=$?"; grep -E "cuda graph|Error|misaligned|File \"/work|^  File|line [0-9]+, in" /tmp/m_$1.log | grep -v lspci | grep -v "^\[rank1\]" | head -30
  python3 -c "
import json
for l in open('/tmp/m_$1/metrics.jsonl'):
    r=json.loads(l); print(r['step'], round(r['loss'],4), r.get('moe/overflow_assignments'), r.get('moe/replayed_steps'))" | tail -4; }
r cf10 --moe_echo.capacity_factor 1.0
