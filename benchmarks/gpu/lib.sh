# Sourced by the GPU run scripts: offline install, then `train NAME NPROC ARGS...` runs the pretrain
# recipe (100 steps, nvlink, capacity 1.5, sync_debug, metrics every 10 steps) into $OUT/NAME.log
# and prints its summary lines and the metrics of steps >= 50.
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

train() {  # name, nproc, extra recipe args
  timeout ${TMO:-150} torchrun --nproc_per_node $2 recipes/pretrain.py --job.config_file train_configs/v2lite_1b_gpu.toml \
    --training.steps 100 --metrics.log_freq 10 --checkpoint.enable false --metrics.enable_tensorboard false \
    --job.dump_folder /tmp/run_$1 --parallelism.expert_parallel_degree $2 --moe_echo.dispatcher nvlink \
    --moe_echo.capacity_factor 1.5 --training.sync_debug true "${@:3}" > "$OUT/$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E 'cuda graph|^(loss|rank load|expert load|overflow|tokens|params) ' $OUT/$1.log | tr '\n' ';')"
  cp /tmp/run_$1/metrics.jsonl "$OUT/$1.jsonl" 2>/dev/null
  python3 -c "
import json; r=[json.loads(l) for l in open('/tmp/run_$1/metrics.jsonl')]; late=[x for x in r if x['step']>=50 and 'tokens_per_s' in x]
print('tok/s', [round(x['tokens_per_s']) for x in late], 'mfu', [round(x.get('mfu_pct',0),1) for x in late],
      'overflow', r[-1].get('moe/overflow_assignments'), 'replayed', r[-1].get('moe/replayed_steps'))" 2>&1 | tail -1
}
