#!/usr/bin/env bash
# Prepared for an 8-GPU host (nvidia-h200-x8); not yet run (that kind was not lent in sessions 3-4).
# PART=a: tests/test_gpu_ep.py on GPUs 0,1 (on the nvlink-push branch: fp32 nvlink push == alltoall),
#         dispatch + combine at EP=2 (nvlink vs alltoall vs padded vs peer copy; push too on that
#         branch), then EP=8.
# PART=b: v2lite_1b at EP=8, nvlink, capacity 1.5, 100 steps, sync_debug: natural / 8 hot experts,
#         ECHO off / on (issue 6's EP=8 rows).
# PART=c: the 8-GPU row of scaling_H200.md (same settings as run_scaling.sh: padded, ECHO on), then
#         v2lite_6b at EP=8, ECHO on, graphed, 30 steps.
set -uo pipefail
source benchmarks/gpu/lib.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l); echo "GPUs: $N"
if [ "${PART:-a}" = c ]; then
  train g8_ep8_echo $N --moe_echo.echo true --moe_echo.dispatcher padded --metrics.log_freq 20
  TMO=240 train e8_v6_graph $N --model.flavor v2lite_6b --moe_echo.echo true --training.cuda_graph true \
    --training.steps 30 --metrics.log_freq 1
elif [ "${PART:-a}" = a ]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q -s 2>&1 | tail -9
  CUDA_VISIBLE_DEVICES=0,1 timeout 170 torchrun --nproc_per_node 2 benchmarks/dispatch.py --no-vdev --sweep 64 \
    --block-t 1 --out "$OUT" 2>&1 | grep -v "^{\|^W11\|[Ww]arn" | tail -14
  timeout 170 torchrun --nproc_per_node $N benchmarks/dispatch.py --tokens 16384 --no-vdev --sweep 64 --block-t 1 \
    --out "$OUT" 2>&1 | grep -v "^{\|^W11\|[Ww]arn" | tail -10
else
  train e8_natural_off $N
  train e8_natural_on $N --moe_echo.echo true
  TMO=300 train e8_skewed_off $N --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
  train e8_skewed_on $N --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true \
    --moe_echo.echo_slots_per_rank 4
fi
