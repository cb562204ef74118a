set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
r() { timeout 100 torchrun --nproc_per_node 2 recipes/pretrain.py --job.config_file train_configs/debug_gpu.toml --training.steps 24 \
  --metrics.log_freq 1 --metrics.enable_tensorboard false --parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink \
  --moe_echo.capacity_factor 1.0 --moe_echo.grow_capacity_after 2 --job.dump_folder /tmp/d_$1 "${@:2}" > /tmp/d_$1.log 2>&1
  echo "== $1 rc=$?"; grep -E "cuda graph|error|Error|misaligned|File \"/work" /tmp/d_$1.log | grep -v lspci | sort | uniq -c | head -12
  python3 -c "
import json
for l in open('/tmp/d_$1/metrics.jsonl'):
    r=json.loads(l); print(r['step'], round(r['loss'],4), r.get('moe/overflow_assignments'), r.get('moe/replayed_steps'))" | tail -6; }
r eager
CUDA_LAUNCH_BLOCKING=1 r graph --training.cuda_graph true
r graph_nb --training.cuda_graph true
