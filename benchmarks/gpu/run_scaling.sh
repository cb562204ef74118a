#!/usr/bin/env bash
# 4-GPU call: tokens/s per GPU of v2lite_1b at 1, 2 and 4 GPUs (EP = GPUs, ECHO on for EP>1), 100 steps each.
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
run() {  # n_gpus, name, extra
  timeout 80 torchrun --nproc_per_node $1 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml --training.steps 100 \
    --metrics.log_freq 20 --checkpoint.enable false --metrics.enable_tensorboard false --job.dump_folder /tmp/s_$2 "${@:3}" > "$OUT/s_$2.log" 2>&1
  echo "== $2 rc=$? $(grep -E '^(rank load|overflow) ' $OUT/s_$2.log | tr '\n' ';')"
  python3 -c "import json; r=[json.loads(l) for l in open('/tmp/s_$2/metrics.jsonl')]; s=[x for x in r if x['step']>=60]; t=sum(x['tokens_per_s'] for x in s)/len(s); print('$2 gpus=$1 tok/s', round(t), 'per GPU', round(t/$1), 'mfu', round(sum(x.get('mfu_pct',0) for x in s)/len(s),1), 'replayed', r[-1].get('moe/replayed_steps'))"
}
run 1 g1
run 2 g2_ep2_echo --parallelism.expert_parallel_degree 2 --moe_echo.echo true --moe_echo.capacity_factor 1.5
run 4 g4_ep4_echo --parallelism.expert_parallel_degree 4 --moe_echo.echo true --moe_echo.capacity_factor 1.5
