#!/usr/bin/env bash
# Session 3, first call on a 4-GPU host: issue 5's GPU tests on two GPU pairs at once.
#   GPUs 0,1: tests/test_gpu_train.py (sync-free + graph==eager: local, ECHO+nvlink, padded; overflow
#             replay eager and graphed), then the same overflow test with graph re-capture after replays.
#   GPUs 2,3: pinned-staging probe, tests/test_gpu_ep.py (ECHO multicast over nvlink vs alltoall in
#             fp32), then v2lite_1b EP=2 nvlink graphed with re-capture after replays (the case that
#             crashed in session 2).
# (Ran on 2026-11-22 with the re-capture switched by an environment variable, the same code path as
# [training] cuda_graph_after_replay = "recapture" now.)
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -4
grep -c "was_allocated_during_stream_capture" $(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/include/ATen/core/CachingHostAllocator.h
(
  export CUDA_VISIBLE_DEVICES=0,1 PET_MASTER_PORT=29510
  timeout 330 python3 -m pytest tests/test_gpu_train.py -p no:warnings -q -s > "$OUT/gpu_train.log" 2>&1
  echo "gpu_train rc=$?" >> "$OUT/gpu_train.log"
  timeout 150 python3 -m pytest tests/test_gpu_train.py -k "overflow and recapture" \
    -p no:warnings -q -s > "$OUT/recapture_debug.log" 2>&1
  echo "recapture_debug rc=$?" >> "$OUT/recapture_debug.log"
) &
(
  export CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29520
  timeout 60 python3 benchmarks/probe_graph_pinned.py > "$OUT/probe.log" 2>&1
  timeout 240 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q -s > "$OUT/gpu_ep.log" 2>&1
  echo "gpu_ep rc=$?" >> "$OUT/gpu_ep.log"
  timeout 180 torchrun --nproc_per_node 2 --master_port 29530 recipes/pretrain.py \
    --job.config_file train_configs/v2lite_1b_gpu.toml --training.steps 40 --metrics.log_freq 1 \
    --metrics.enable_tensorboard false --checkpoint.enable false --parallelism.expert_parallel_degree 2 \
    --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5 --training.cuda_graph true --training.cuda_graph_after_replay recapture \
    --job.dump_folder /tmp/v2_recap > "$OUT/recapture_v2lite.log" 2>&1
  echo "recapture_v2lite rc=$?" >> "$OUT/recapture_v2lite.log"
  cp /tmp/v2_recap/metrics.jsonl "$OUT/recapture_v2lite_metrics.jsonl" 2>/dev/null
) &
wait
cat "$OUT/probe.log"
for f in gpu_train gpu_ep recapture_debug; do echo "== $f"; tail -8 "$OUT/$f.log"; done
echo "== recapture_v2lite"; grep -E "cuda graph|rc=|rror|misaligned|overflow " "$OUT/recapture_v2lite.log" | grep -v "^\[rank1\]" | head -20
python3 -c "
import json
for l in open('$OUT/recapture_v2lite_metrics.jsonl'):
    r=json.loads(l); print(r['step'], round(r['loss'],4), r.get('moe/overflow_assignments'), r.get('moe/replayed_steps'))" 2>&1 | tail -8
