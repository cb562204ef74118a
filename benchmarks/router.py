"""The router's forward + backward on one GPU: the gate as one bf16 GEMM writing fp32 (``gate_logits``) and the
fused kernels after it (kernels/router.py), each against the torch path (fp32 gate GEMM of upcast operands).

    python benchmarks/router.py [--out DIR]     -> router_1x<GPU>.md / .json

Each shape is a config's router with bf16 parameters (as training runs it): T bf16 tokens of dim D, E experts,
top-K, score function, renormalised or not, with the aux-loss-free bias. Every variant times the same TopKRouter
forward and backward of a weighted sum of its combine weights, eagerly (``*_ms``) and replayed from a CUDA graph
(``*_graph_ms``: the training step is graphed, so that is the one that counts there).
"""

import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import environment, graphed, markdown_table, time_ms, write_results
from components.moe_echo import router as router_module
from components.moe_echo.router import TopKRouter

VARIANTS = [  # (name, the gate as one bf16 GEMM writing fp32, the fused kernels after it)
    ("torch", False, False), ("bf16_gate", True, False), ("fused_tail", False, True), ("fused", True, True)]
SHAPES = {  # name: (E, K, score_func, route_norm)
    "v2lite": (64, 6, "softmax", False),
    "qwen3": (128, 8, "softmax", True),
    "deepseek_v3": (256, 8, "sigmoid", True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        E, K, func, norm = SHAPES[name]
        r = TopKRouter(a.dim, E, K, score_func=func, route_norm=norm).cuda().bfloat16()  # bf16 parameters
        x = torch.randn(a.tokens, a.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(E, device="cuda") * 0.01
        c_TK = torch.randn(a.tokens, K, device="cuda")

        def step():
            (r(x, bias).topk_w_TK * c_TK).sum().backward()

        row = {"shape": name, "T": a.tokens, "D": a.dim, "E": E, "K": K, "score": func, "norm": norm}
        for path, bf16_gate, fused_tail in VARIANTS:
            with mock.patch.object(router_module, "_bf16_gate_applies", router_module._bf16_gate_applies
                                   if bf16_gate else (lambda *_: False)), \
                 mock.patch.object(router_module.router_kernels, "fusable", router_module.router_kernels.fusable
                                   if fused_tail else (lambda *_: False)):
                row[f"{path}_ms"], row[f"{path}_graph_ms"] = time_ms(step), time_ms(graphed(step))
        row["speedup_graph"] = row["torch_graph_ms"] / row["fused_graph_ms"]
        rows.append(row)
        print(row, flush=True)
    cols = ["shape", "T", "D", "E", "K", "score", "norm", "torch_ms", "fused_ms"]
    cols += [f"{v[0]}_graph_ms" for v in VARIANTS] + ["speedup_graph"]
    env = environment()
    table = (f"Router forward + backward on {env['gpu']} (benchmarks/router.py; torch {env['torch']}, "
             f"{env['date']})\n\n" + markdown_table(rows, cols))
    print(table)
    write_results("router", env, rows, table, a.out)


if __name__ == "__main__":
    main()
