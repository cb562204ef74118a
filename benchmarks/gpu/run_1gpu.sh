#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, the MoE-layer benchmark and short
# recipe runs on one GPU. Results land in $OUT (the device tool) or ./gpu_out.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest tests/test_gpu.py tests/test_kernels.py tests/test_layer.py tests/test_models.py -p no:warnings 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 benchmarks/moe_layer.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/moe_layer.log" | tail -40
for cfg in ${RECIPES-debug_gpu v2lite_1b_gpu qwen3_30b_a3b_small_gpu}; do
  python3 recipes/pretrain.py --job.config_file train_configs/$cfg.toml --training.steps 40 --metrics.log_freq 10 \
    --checkpoint.enable false --job.dump_folder /tmp/run_$cfg > "$OUT/recipe_$cfg.log" 2>&1
  echo "== $cfg rc=$?"; grep -v "step/s\]$" "$OUT/recipe_$cfg.log" | tail -14
  tail -3 /tmp/run_$cfg/metrics.jsonl | cut -c1-400
done
