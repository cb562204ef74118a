#!/usr/bin/env bash
# Session 3, 4-GPU host: bisect the EP=4 graphed failure (debug model with/without ECHO, v2lite_6b
# 20 steps logged every step), then v2lite_6b with 8 hot experts, ECHO off (capacity grows after
# every replay so the run reaches its steady state within the time limit).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
g() {  # name, timeout, args
  timeout $2 torchrun --nproc_per_node 4 recipes/pretrain.py --metrics.log_freq 1 --checkpoint.enable false \
    --metrics.enable_tensorboard false --job.dump_folder /tmp/g_$1 --parallelism.expert_parallel_degree 4 \
    --moe_echo.dispatcher nvlink --training.sync_debug true "${@:3}" > "$OUT/g_$1.log" 2>&1
  echo "== $1 rc=$? last step: $(tail -1 /tmp/g_$1/metrics.jsonl 2>/dev/null | cut -c1-60) | $(grep -E 'cuda graph' $OUT/g_$1.log | grep -v '^\[' | sort -u | tr '\n' ';')"
  grep -m2 -E "Assertion|Error:|error:" "$OUT/g_$1.log" | grep -v lspci | cut -c1-200
}
g dbg_echo 90 --job.config_file train_configs/debug_gpu.toml --training.steps 20 --moe_echo.echo true --training.cuda_graph true
g dbg_noecho 90 --job.config_file train_configs/debug_gpu.toml --training.steps 20 --training.cuda_graph true
g v6_echo 120 --job.config_file train_configs/v2lite_1b_gpu.toml --model.flavor v2lite_6b --training.steps 20 \
  --moe_echo.capacity_factor 1.5 --moe_echo.echo true --training.cuda_graph true
N=4
source <(sed -n '/^run() {/,/^}/p' benchmarks/gpu_run_s3_scale.sh)
TMO=280 run skewed_off --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.grow_capacity_after 1
