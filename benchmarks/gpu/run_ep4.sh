#!/usr/bin/env bash
# 4-GPU call (issue: scaling run): dispatch at EP=4, and the ~1B config at EP=4 with ECHO off/on under
# natural and strongly skewed routing (tokens/s, MFU, imbalance, overflow/replays). Writes $OUT.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -4 | tr '\n' ';'; echo
timeout 150 torchrun --nproc_per_node 4 benchmarks/dispatch.py --tokens 16384 --hidden 2048,7168 --out "$OUT" 2>&1 | grep -v "^{\|^W1122\|[Ww]arn" | tail -7
run() {  # name, extra args
  timeout 100 torchrun --nproc_per_node 4 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml --training.steps 60 \
    --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false --job.dump_folder /tmp/q_$1 \
    --parallelism.expert_parallel_degree 4 --moe_echo.dispatcher padded --moe_echo.capacity_factor 1.5 "${@:2}" > "$OUT/q_$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E '^(loss|rank load|expert load|overflow) ' $OUT/q_$1.log | tr '\n' ';')"
  python3 -c "import json; r=[json.loads(l) for l in open('/tmp/q_$1/metrics.jsonl')]; print('tok/s', [round(x['tokens_per_s']) for x in r if x['step']>=30], 'mfu', [round(x.get('mfu_pct',0),1) for x in r if x['step']>=30], 'replayed', r[-1].get('moe/replayed_steps'))"
}
run natural_off
run natural_on --moe_echo.echo true
run skewed_off --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8
run skewed_on --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
