#!/usr/bin/env bash
# 2-GPU call: EP sync-free checks (padded, padded+ECHO), dropless replay on GPU, fastest-dispatcher
# selection, and ECHO on/off throughput with hot experts (v2lite_1b, EP=2).
set -uo pipefail
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pytest tests/test_gpu_ep.py -p no:warnings -s 2>&1 | grep -E "echo=|passed|failed|Error" | head
run() {  # name, extra args
  torchrun --nproc_per_node 2 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml --training.steps 40 \
    --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false --job.dump_folder /tmp/f_$1 \
    --parallelism.expert_parallel_degree 2 --moe_echo.bias_update_rate 0 --moe_echo.debug_hot_experts 8 "${@:2}" \
    > "$OUT/f_$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E '^(loss|rank load|peak|overflow|dispatcher) |^dispatcher: fastest' $OUT/f_$1.log | tr '\n' ';')"
  python3 -c "import json; r=[json.loads(l) for l in open('/tmp/f_$1/metrics.jsonl')]; print('steady tok/s', [round(x['tokens_per_s']) for x in r if x['step']>=20], 'replayed', [x['step'] for x in r if x.get('moe/replayed')])"
}
run off_padded_cf2 --moe_echo.dispatcher padded --moe_echo.capacity_factor 2.0
run on_padded_cf1.25 --moe_echo.dispatcher padded --moe_echo.capacity_factor 1.25 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
run off_replay_cf1 --moe_echo.dispatcher padded --moe_echo.capacity_factor 1.0 --moe_echo.grow_capacity_after 1
run off_alltoall --moe_echo.dispatcher alltoall
run on_fastest --moe_echo.dispatcher fastest --moe_echo.capacity_factor 1.25 --moe_echo.echo true --moe_echo.echo_slots_per_rank 4
