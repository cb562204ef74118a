"""How fast an FP8 step could be: Amdahl's bound from a measured bf16 step profile and the model's GEMM shapes.

FP8 speeds up only the GEMMs it converts. From a step_breakdown JSON (GPU time per category of one bf16 step) and
the model's linear layers (built on the meta device), the share of the step FP8 can touch is

    dense:   the "dense GEMMs" share × the FLOP share of the converted nn.Linears (all but the output head and the
             router gates, as ``[model] converters = ["float8"]`` converts them by default)
    experts: the "routed experts" share (their grouped GEMMs and the SwiGLU between them)
    head:    with the output head converted too, the "dense GEMMs" share × its FLOP share × the fraction of its
             three GEMMs a converted head runs in FP8 (``Fp8Head.fp8_gemms``: the logits and the weight gradient)

and the step with those parts ``s`` times faster, everything else (quantisation included) free, is at most
1 / (1 - share · (1 - 1/s)) times the bf16 step. A measured FP8 step below the bound by much means quantisation
or unfused scaling costs eat the gain; a target above the bound cannot be met on that shape.

    python benchmarks/fp8_bound.py benchmarks/results/step_breakdown_v2lite_1b_gpu_graph_compile_ep1_vs_ep2_2xH200.json \\
        --run 0 --config v2lite_1b_gpu --gpu H200
"""

import argparse
import json
import os
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from components.moe_echo.models import MODEL_CLASSES, model_args_for  # noqa: E402
from components.train.float8 import ALWAYS_KEPT, DEFAULT_KEPT, HEAD  # noqa: E402
from components.train.fp8_head import GEMMS, Fp8Head  # noqa: E402

SPEEDUPS = (1.5, 2.0)  # FP8 GEMM rate over bf16's: Hopper's peak is 2x; mid-sized GEMMs reach less


def linear_flops(name: str, flavor: str, kept=DEFAULT_KEPT) -> tuple[float, float]:
    """(converted, kept) forward FLOPs per token of the model's nn.Linear layers (2 · in · out each); ``kept``:
    the names float8 leaves in bf16 (the router gates always)."""
    with torch.device("meta"):
        model = MODEL_CLASSES[name](model_args_for(name, flavor, None))
    converted = left = 0.0
    for fqn, m in model.named_modules():
        if type(m) is nn.Linear:
            f = 2.0 * m.in_features * m.out_features
            if any(k in fqn for k in (*ALWAYS_KEPT, *kept)):
                left += f
            else:
                converted += f
    return converted, left


def bound(share: float, s: float) -> float:
    """The step's speedup when ``share`` of it runs ``s`` times faster and the rest is unchanged."""
    return 1.0 / (1.0 - share * (1.0 - 1.0 / s))


def config_model(config: str) -> tuple[str, str]:
    import tomllib

    with open(os.path.join(ROOT, "train_configs", f"{config}.toml"), "rb") as f:
        m = tomllib.load(f)["model"]
    return m["name"], m["flavor"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("breakdown", help="a step_breakdown JSON of a bf16 step")
    ap.add_argument("--run", type=int, default=0, help="which of its runs (0: the first column)")
    ap.add_argument("--config", default="v2lite_1b_gpu", help="train_configs/<config>.toml: the profiled model")
    ap.add_argument("--gpu", default="H200", help="the GPU the profile ran on (names the results file)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    a = ap.parse_args()
    with open(a.breakdown) as f:
        pct = json.load(f)[a.run]["pct"]
    converted, left = linear_flops(*config_model(a.config))
    with_head, _ = linear_flops(*config_model(a.config), kept=())
    dense = pct["dense GEMMs"] / 100 * converted / (converted + left)
    experts = pct["routed experts"] / 100
    head_gemms = len(Fp8Head.fp8_gemms) / len(GEMMS)
    head = pct["dense GEMMs"] / 100 * (with_head - converted) / (converted + left) * head_gemms
    rows = []
    for what, share in (("dense layers", dense), ("routed experts", experts), ("both", dense + experts),
                        (f"both, the {HEAD} head converted ({', '.join(Fp8Head.fp8_gemms)})", dense + experts + head)):
        rows.append({"fp8_on": what, "share_of_step_pct": round(100 * share, 1),
                     **{f"bound_{s}x_gemms": round(bound(share, s), 3) for s in SPEEDUPS}})
    note = (f"{a.config}: the converted linears are {100 * converted / (converted + left):.0f}% of the dense GEMM FLOPs "
            f"(the output head and router gates stay bf16); profile: {os.path.basename(a.breakdown)}, run {a.run}")
    table = note + "\n\n" + markdown_table(rows, list(rows[0]))
    print(table)
    env = {**environment(), "gpu": "cpu", "profile_gpu": a.gpu}
    write_results(f"fp8_bound_{a.config}_{a.gpu}", env, rows, table, a.out,
                  script=f"benchmarks/fp8_bound.py {os.path.relpath(a.breakdown, ROOT)} --run {a.run} --config {a.config}")

if __name__ == "__main__":
    main()
