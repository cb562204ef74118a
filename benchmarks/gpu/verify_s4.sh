#!/usr/bin/env bash
# 2-GPU call (nvidia-h200-x2) for what session 4 changed without GPU time left to check it:
# the GPU training tests (warm-up on the current stream, graph == eager, overflow replay, capacity
# grow-to-fit on nvlink, tokens/s timed with CUDA events) and the EP tests; then the push combine
# (wip/nvlink_push.patch) applied in a scratch copy: its fp32 nvlink-push == alltoall check and the
# EP=2 dispatch benchmark with pull vs push columns.
set -uo pipefail
source benchmarks/gpu/lib.sh
timeout 420 python3 -m pytest -x tests/test_gpu_train.py tests/test_gpu_ep.py -p no:warnings -q 2>&1 | tail -6
rm -rf /tmp/push && mkdir /tmp/push && tar --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C /tmp/push
(cd /tmp/push && { patch -p1 -s < "$OLDPWD/wip/nvlink_push.patch" || git apply "$OLDPWD/wip/nvlink_push.patch"; } && export PYTHONPATH=/tmp/site:/tmp/push &&
  timeout 200 python3 -m pytest -x tests/test_gpu_ep.py -p no:warnings -q 2>&1 | tail -4 &&
  timeout 170 torchrun --nproc_per_node 2 benchmarks/dispatch.py --no-vdev --out "$OUT" 2>&1 | grep -v "^{\|^W11\|[Ww]arn" | tail -12)
