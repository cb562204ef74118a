#!/usr/bin/env bash
# Diagnose two v2lite_6b EP=4 failures: (1) graphed ECHO run asserts in the grouped GEMM (warm-up
# step, eager on a side stream) — rerun with CUDA_LAUNCH_BLOCKING=1 to get the failing op's stack;
# (2) 8 hot experts without ECHO hangs after the first replay — dump every worker's Python stack.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
common="recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml --model.flavor v2lite_6b --metrics.log_freq 1
  --checkpoint.enable false --metrics.enable_tensorboard false --parallelism.expert_parallel_degree 4
  --moe_echo.dispatcher nvlink --moe_echo.capacity_factor 1.5"
CUDA_LAUNCH_BLOCKING=1 timeout 100 torchrun --nproc_per_node 4 $common --job.dump_folder /tmp/d1 --training.steps 3 \
  --moe_echo.echo true --training.cuda_graph true > "$OUT/d1.log" 2>&1
echo "== d1 rc=$?"; grep -v "^\[rank[123]\]" "$OUT/d1.log" | grep -E "File \"/work|Error|error|Assert" | grep -v lspci | head -30 | cut -c1-220
torchrun --nproc_per_node 4 --master_port 29555 $common --job.dump_folder /tmp/d2 --training.steps 30 \
  --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 > "$OUT/d2.log" 2>&1 &
sleep 75; pkill -ABRT -f "d2 --training" ; sleep 5; pkill -9 -f torchrun; wait
echo "== d2"; tail -2 /tmp/d2/metrics.jsonl | cut -c1-80
grep -E "Thread|File \"/work" "$OUT/d2.log" | head -60 | cut -c1-200
