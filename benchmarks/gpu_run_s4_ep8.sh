#!/usr/bin/env bash
# Prepared for the next session on an 8-GPU host (nvidia-h200-x8), not yet run.
# PART=a: the push-combine check (tests/test_gpu_ep.py on GPUs 0,1: fp32 nvlink push == alltoall),
#         dispatch + combine at EP=2 (pull vs push vs alltoall vs padded vs peer copy), then EP=8.
# PART=b: v2lite_1b at EP=8, nvlink, capacity 1.5, 100 steps, sync_debug: natural / 8 hot experts,
#         ECHO off / on (issue 6's EP=8 rows).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l); echo "GPUs: $N"
if [ "${PART:-a}" = a ]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q -s 2>&1 | tail -9
  CUDA_VISIBLE_DEVICES=0,1 timeout 170 torchrun --nproc_per_node 2 benchmarks/dispatch.py --no-vdev --sweep 64 \
    --block-t 1 --out "$OUT" 2>&1 | grep -v "^{\|^W11\|[Ww]arn" | tail -14
  timeout 170 torchrun --nproc_per_node $N benchmarks/dispatch.py --tokens 16384 --no-vdev --sweep 64 --block-t 1 \
    --out "$OUT" 2>&1 | grep -v "^{\|^W11\|[Ww]arn" | tail -10
else
  run() {  # name, extra args
    timeout 150 torchrun --nproc_per_node $N recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml \
      --training.steps 100 --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false \
      --job.dump_folder /tmp/e8_$1 --parallelism.expert_parallel_degree $N --moe_echo.dispatcher nvlink \
      --moe_echo.capacity_factor 1.5 --training.sync_debug true "${@:2}" > "$OUT/e8_$1.log" 2>&1
    echo "== $1 rc=$? $(grep -E '^(loss|rank load|overflow|tokens) ' $OUT/e8_$1.log | tr '\n' ';')"
    cp /tmp/e8_$1/metrics.jsonl "$OUT/e8_$1.jsonl" 2>/dev/null
  }
  run natural_off
  run natural_on --moe_echo.echo true
  run skewed_off --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
  run skewed_on --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
fi
