"""The router's forward + backward, the fused kernels (kernels/router.py) against its torch path, one GPU.

    python benchmarks/router.py [--out DIR]     -> router_<GPU>.md / .json

Each shape is a config's router: T tokens of dim D, E experts, top-K, score function, renormalised or not, with
the aux-loss-free bias. Both columns time the same TopKRouter (gate GEMM in fp32 included) forward and backward
of a weighted sum of its combine weights, eagerly and replayed from a CUDA graph (the training step is graphed,
so the graphed column is the one that counts there); ``after_gate_*`` subtracts the gate GEMM alone (forward +
backward, timed the same way) to show the part the kernels replace.
"""

import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from benchmarks.common import environment, markdown_table, time_ms, write_results
from components.moe_echo import router as router_module
from components.moe_echo.router import TopKRouter

SHAPES = {  # name: (E, K, score_func, route_norm)
    "v2lite": (64, 6, "softmax", False),
    "qwen3": (128, 8, "softmax", True),
    "deepseek_v3": (256, 8, "sigmoid", True),
}


def graphed(fn):
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream); the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


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
        r = TopKRouter(a.dim, E, K, score_func=func, route_norm=norm).cuda()
        x = torch.randn(a.tokens, a.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(E, device="cuda") * 0.01
        c_TK = torch.randn(a.tokens, K, device="cuda")

        def step():
            (r(x, bias).topk_w_TK * c_TK).sum().backward()

        def gate():
            F.linear(x.float(), r.gate.weight).sum().backward()

        row = {"shape": name, "T": a.tokens, "D": a.dim, "E": E, "K": K, "score": func, "norm": norm}
        gate_graph = time_ms(graphed(gate))
        for path, fusable in [("torch", lambda *_: False), ("fused", router_module.router_kernels.fusable)]:
            with mock.patch.object(router_module.router_kernels, "fusable", fusable):
                eager, graph = time_ms(step), time_ms(graphed(step))
            row[f"{path}_ms"], row[f"{path}_graph_ms"] = eager, graph
            row[f"after_gate_{path}_graph_ms"] = graph - gate_graph
        row["speedup_graph"] = row["torch_graph_ms"] / row["fused_graph_ms"]
        row["after_gate_speedup"] = row["after_gate_torch_graph_ms"] / max(row["after_gate_fused_graph_ms"], 1e-6)
        rows.append(row)
        print(row, flush=True)
    cols = ["shape", "T", "D", "E", "K", "score", "norm", "torch_ms", "fused_ms", "torch_graph_ms", "fused_graph_ms",
            "speedup_graph", "after_gate_torch_graph_ms", "after_gate_fused_graph_ms", "after_gate_speedup"]
    env = environment()
    table = (f"Router forward + backward on {env['gpu']} (benchmarks/router.py; torch {env['torch']}, "
             f"{env['date']})\n\n" + markdown_table(rows, cols))
    print(table)
    write_results(f"router_{env['gpu'].replace(' ', '_')}", env, rows, table, a.out)


if __name__ == "__main__":
    main()
