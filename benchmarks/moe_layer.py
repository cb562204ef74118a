"""MoE layer fwd+bwd: moe-echo's layer vs torchtitan 0.2.2's MoE vs a dense bf16 SwiGLU of equal FLOPs.

Both MoE layers get identical weights, router bias and inputs (so identical routing); outputs are
cross-checked on the tokens whose expert sets agree (our router scores in fp32, torchtitan's in
bf16, so near-ties can differ; the agreeing fraction is reported). Routed FLOPs (fwd+bwd) = 18·T·K·D·H. Shared experts are off so only routed work is
compared. 'skewed' routing comes from a Zipf-shaped router bias; its max/mean expert load is reported.
The tensor cores' reachable rate is measured in the same run: a plain bf16 GEMM (16384×4096×4096,
``plain_gemm_tflops``); ``frac_of_peak_gemm`` = the layer's routed TFLOP/s over it. ``precision`` names
the experts' GEMM precision: each case also runs with ``expert_precision = "fp8"`` on Hopper (its row's
reference is a rowwise-scaled FP8 ``torch._scaled_mm`` of the same shape; ``fp8_speedup_vs_bf16`` is
the bf16 row's time over the FP8 row's; ``fp8_out_rel_diff`` its output against the bf16 layer's).
``fp8_weights`` names where an FP8 row's weight copies come from: ``cast`` (cast from the weights in every
forward and backward) or ``copies`` (``Fp8WeightCopies``, written by the optimizer step; the row's times add
``fp8_copy_write_ms``, what writing them costs that step: the optimizer's pass over this layer's experts with
the FP8 copies minus without, so the ratio charges the layer for its copies).
``experts_gemm`` names the kernels of the bf16 expert GEMMs: ``torch`` (``torch._grouped_mm``) and, where
quack-kernels is installed on a Hopper GPU, a ``quack`` row (``experts_gemm = "quack"``: QuACK's grouped
GEMMs with SwiGLU in their epilogues; ``quack_out_rel_diff`` its output against the torch row's), and a
``quack_gathered`` row (``gathered_experts = true``: the GEMMs read token rows by index and the combine weights
sit in their epilogues; no expert-major copy of the tokens).
``*_graph_ms``: our layer's fwd+bwd captured in a CUDA graph, as the graphed training step runs it (no host
launch time; the eager columns include it), the median of three captures (``graphed_ms``):
``frac_of_peak_gemm_graph`` and ``fp8_speedup_vs_bf16_graph`` from them.

``megatron_ms``: Megatron-Core 0.16.1's MoE layer on the same weights, routing bias and inputs
(``benchmarks/megatron_layer.py``): no transformer-engine, so its non-TE grouped path — GroupedMLP
on the ``grouped_gemm`` CUDA extension — or, without that extension, SequentialMLP; ``megatron_path``
names the one measured. Its outputs are cross-checked like torchtitan's (``megatron_routing_agree``,
``megatron_out_rel_diff``). Without megatron-core the column is empty and the reason is printed.

    python benchmarks/moe_layer.py [--out DIR] [--megatron-dispatcher allgather|alltoall]
                                   [--tokens T] [--case I ...] [--routing balanced|skewed ...]
"""

import argparse
import dataclasses
import os
import statistics
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torchtitan.models.moe import MoE, MoEArgs

from benchmarks import megatron_layer
from benchmarks.common import environment, graphed, markdown_table, time_ms, write_results
from benchmarks.optimizer_pass import fp8_copies_pass_ms
from components.moe_echo.config import MoEEchoConfig
from components.moe_echo.layer import MoELayer

CASES = [  # (T, D, H, E, K)
    (16384, 2048, 1408, 64, 6),
    (16384, 2048, 768, 128, 8),
]


def zipf_bias(E: int, s: float, scale: float, gen: torch.Generator) -> torch.Tensor:
    ranks = torch.randperm(E, generator=gen).float() + 1
    z = ranks.pow(-s)
    return scale * z / z.max()


PROFILE, PROFILED, FP8, QUACK = False, [], False, False
MEGATRON = {"ok": False, "dispatcher": "allgather"}  # set by main()


def megatron_columns(ours, x, fwd_bwd, flops) -> dict:
    """Megatron-Core's layer on ``ours``' weights and bias: check against ours, then time fwd+bwd."""
    if not MEGATRON["ok"]:
        return {}
    try:
        mega = megatron_layer.build_megatron_moe(ours, dispatcher=MEGATRON["dispatcher"])
        agree, rel = megatron_layer.compare(ours, mega, x)
        ms = time_ms(fwd_bwd(mega))
    except Exception as e:  # keep the other columns of the run
        traceback.print_exc()
        print(f"megatron_ms: not measured ({type(e).__name__}: {e})", flush=True)
        return {}
    return {"megatron_ms": ms, "megatron_tflops": flops / (ms * 1e-3) / 1e12, "megatron_path": mega.path,
            "megatron_dispatcher": MEGATRON["dispatcher"], "megatron_routing_agree": agree,
            "megatron_out_rel_diff": rel}


GRAPH_CAPTURES = 3


def graphed_ms(fn) -> float | None:
    """ms of ``fn`` replayed from a CUDA graph: the median over ``GRAPH_CAPTURES`` separate captures of each one's
    median replay (on H200 one capture of an FP8 layer came out up to 1.1 ms, ~13%, slower than another of the same
    layer; eager times vary far less), or None (with the reason printed) where capture fails."""
    try:
        per_capture = [time_ms(graphed(fn)) for _ in range(GRAPH_CAPTURES)]
    except Exception as e:  # keep the eager columns of the run
        print(f"graphed timing: not measured ({type(e).__name__}: {str(e).splitlines()[0]})", flush=True)
        return None
    print("graphed captures: " + ", ".join(f"{t:.3f}" for t in per_capture) + " ms", flush=True)
    return statistics.median(per_capture)


def run_case(T, D, H, E, K, routing, dev):
    torch.manual_seed(0)
    args = MoEArgs(num_experts=E, num_shared_experts=0, top_k=K, score_func="softmax", route_norm=False,
                   score_before_experts=False, use_grouped_mm=True)
    ours = MoELayer(args, D, H, MoEEchoConfig()).to(dev)
    ours.init_weights(0.02, torch.device(dev))
    ours.to(torch.bfloat16)
    ours.expert_bias.data = ours.expert_bias.float()
    theirs = MoE(args, D, H).to(dev)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    theirs.to(torch.bfloat16)
    theirs.expert_bias.data = theirs.expert_bias.float()
    if routing == "skewed":
        bias = zipf_bias(E, 1.2, 0.05, torch.Generator().manual_seed(1)).to(dev)
        ours.expert_bias.copy_(bias)
        theirs.expert_bias.copy_(bias)

    x = torch.randn(T // 4096, 4096, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    with torch.no_grad():
        ours.tokens_per_expert.zero_()
        y_ours = ours(x)
        load = ours.tokens_per_expert.float()
        y_theirs = theirs(x)
        # our router scores in fp32, torchtitan's in bf16: near-ties may pick different experts, so the
        # outputs are compared on the tokens whose expert sets agree
        x_TD = x.view(-1, D)
        ids_ours = ours.router(x_TD, ours.expert_bias).topk_ids_TK.sort(-1).values
        ids_theirs = theirs.router(x_TD, theirs.expert_bias)[1].sort(-1).values
        same_T = (ids_ours == ids_theirs).all(-1)
        a, b = y_ours.view(-1, D)[same_T].float(), y_theirs.view(-1, D)[same_T].float()
    rel = float((a - b).norm() / b.norm())
    agree = float(same_T.float().mean())
    imbalance = float(load.max() / load.mean())

    def fwd_bwd(layer):
        def fn():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).backward(g)
        return fn

    M = T * K
    xd = torch.randn(M, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w3 = torch.randn(H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(D, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gd = torch.randn(M, D, device=dev, dtype=torch.bfloat16)

    def dense_once():
        for t in (xd, w1, w2, w3):
            t.grad = None
        y = (F.silu(xd @ w1.t()) * (xd @ w3.t())) @ w2.t()
        y.backward(gd)

    flops = 18 * T * K * D * H
    t_ours = time_ms(fwd_bwd(ours))
    t_ours_graph = graphed_ms(fwd_bwd(ours))
    fp8 = {}
    if FP8:  # the same layer with FP8 expert GEMMs: time, and its output against the bf16 layer's
        ours.experts.precision = "fp8"
        with torch.no_grad():
            y8 = ours(x)
        t8, t8_graph = time_ms(fwd_bwd(ours)), graphed_ms(fwd_bwd(ours))
        ours.experts.enable_fp8_copies()  # as the optimizer writes them (from these weights here)
        with torch.no_grad():
            y8c = ours(x)
        t8c, t8c_graph = time_ms(fwd_bwd(ours)), graphed_ms(fwd_bwd(ours))
        ours.experts.fp8_copies = None
        ours.experts.precision = "bf16"
        fp8 = {"fp8_ms": t8, "fp8_graph_ms": t8_graph,
               "fp8_out_rel_diff": float((y8 - y_ours).float().norm() / y_ours.float().norm()),
               "fp8_copies_ms": t8c, "fp8_copies_graph_ms": t8c_graph, "fp8_copy_write_ms": fp8_copy_write_ms(ours),
               "fp8_copies_out_rel_diff": float((y8c - y_ours).float().norm() / y_ours.float().norm())}
    # before the QuACK rows: they move w1's and w3's data into one [w1; w3] tensor (GroupedExperts._shared_13); a
    # profile taken after them showed 1.7 ms of strided copies in the FP8 path that a fresh layer's profile does not
    if PROFILE and not PROFILED:
        PROFILED.append(True)
        from torch.profiler import ProfilerActivity, profile

        for precision in ("bf16", "fp8") if FP8 else ("bf16",):
            ours.experts.precision = precision
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fwd_bwd(ours)()
                torch.cuda.synchronize()
            print(f"our layer, {precision} experts:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
        ours.experts.precision = "bf16"
    quack = {}
    if QUACK:  # the same layer on QuACK's grouped GEMMs: time, and its output against the torch GEMMs'
        ours.experts.gemm = "quack"
        with torch.no_grad():
            yq = ours(x)
        quack = {"quack_ms": time_ms(fwd_bwd(ours)), "quack_graph_ms": graphed_ms(fwd_bwd(ours)),
                 "quack_out_rel_diff": float((yq - y_ours).float().norm() / y_ours.float().norm())}
        ours.cfg = dataclasses.replace(ours.cfg, gathered_experts=True)  # token rows read by index in the GEMMs
        with torch.no_grad():
            yg = ours(x)
        quack.update(quack_gathered_ms=time_ms(fwd_bwd(ours)), quack_gathered_graph_ms=graphed_ms(fwd_bwd(ours)),
                     quack_gathered_out_rel_diff=float((yg - y_ours).float().norm() / y_ours.float().norm()))
        ours.cfg = dataclasses.replace(ours.cfg, gathered_experts=False)
        ours.experts.gemm = "torch"
    t_theirs = time_ms(fwd_bwd(theirs))
    t_dense = time_ms(dense_once)
    tf = lambda ms: flops / (ms * 1e-3) / 1e12
    row = {
        "T": T, "D": D, "H": H, "E": E, "K": K, "routing": routing, "load_max_over_mean": imbalance,
        "ours_ms": t_ours, "ours_graph_ms": t_ours_graph, "torchtitan_ms": t_theirs, "dense_ms": t_dense,
        "ours_tflops": tf(t_ours), "torchtitan_tflops": tf(t_theirs), "dense_tflops": tf(t_dense),
        "speedup_vs_torchtitan": t_theirs / t_ours, "frac_of_dense": t_dense / t_ours,
        "routing_agree": agree, "out_rel_diff": rel, **fp8, **quack,
        "megatron_ms": None, "megatron_tflops": None, "speedup_vs_megatron": None, "megatron_path": None,
    }
    del theirs
    row.update(megatron_columns(ours, x, fwd_bwd, flops))
    if row["megatron_ms"] is not None:
        row["speedup_vs_megatron"] = row["megatron_ms"] / t_ours
    return row


def plain_gemm_tflops(dev: str, m: int = 16384, n: int = 4096, k: int = 4096) -> float:
    """TFLOP/s of one bf16 ``a @ b`` (m×k by k×n) on random data: the rate the experts' GEMMs aim at."""
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=10, iters=50)
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def plain_fp8_gemm_tflops(dev: str, m: int = 16384, n: int = 4096, k: int = 4096) -> float:
    """TFLOP/s of one rowwise-scaled e4m3 ``torch._scaled_mm`` of the same shape (the FP8 rows' reference)."""
    a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
    ms = time_ms(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
                 warmup=10, iters=50)
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def fp8_copy_write_ms(layer: MoELayer) -> float:
    """What the optimizer step pays to write the FP8 weight copies of ``layer``'s experts: its fused AdamW pass
    over the three weights with the FP8 copies written, minus the same pass without them, median ms
    (``benchmarks/optimizer_pass.py``)."""
    ge = layer.experts
    t = fp8_copies_pass_ms(*(w.detach().float() for w in (ge.w1, ge.w2, ge.w3)))
    return t["with_fp8_copies_ms"] - t["adamw_ms"]


def fp8_row(row: dict, gemm8: float, weights: str = "cast") -> dict:
    """The FP8 row of a case: our layer with expert_precision = "fp8" against the same baselines; ``weights``
    "copies": the optimizer-written copies, their write charged to the row (``fp8_copy_write_ms``)."""
    if weights == "copies":
        extra = row["fp8_copy_write_ms"]
        ms = row["fp8_copies_ms"] + extra
        graph = row["fp8_copies_graph_ms"] + extra if row.get("fp8_copies_graph_ms") is not None else None
    else:
        ms, graph = row["fp8_ms"], row.get("fp8_graph_ms")
    tf = row["ours_tflops"] * row["ours_ms"] / ms
    return {**row, "precision": "fp8", "fp8_weights": weights, "ours_ms": ms, "ours_tflops": tf,
            "plain_gemm_tflops": gemm8, "frac_of_peak_gemm": tf / gemm8, "speedup_vs_torchtitan": row["torchtitan_ms"] / ms,
            "frac_of_dense": row["dense_ms"] / ms, "fp8_speedup_vs_bf16": row["ours_ms"] / ms,
            "speedup_vs_megatron": row["megatron_ms"] / ms if row.get("megatron_ms") else None,
            "fp8_copy_write_ms": row.get("fp8_copy_write_ms") if weights == "copies" else None,
            **graph_columns(row, graph, gemm8, "fp8")}


def quack_row(row: dict, gemm: float, name: str = "quack") -> dict:
    """The ``experts_gemm = "quack"`` row of a case (bf16; ``quack_gathered``: with ``gathered_experts``), against
    the same baselines."""
    ms = row[f"{name}_ms"]
    tf = row["ours_tflops"] * row["ours_ms"] / ms
    return {**row, "experts_gemm": name, "ours_ms": ms, "ours_tflops": tf, "frac_of_peak_gemm": tf / gemm,
            "speedup_vs_torchtitan": row["torchtitan_ms"] / ms, "frac_of_dense": row["dense_ms"] / ms,
            "quack_speedup_vs_torch": row["ours_ms"] / ms, "fp8_speedup_vs_bf16": None,
            "quack_out_rel_diff": row[f"{name}_out_rel_diff"],
            "speedup_vs_megatron": row["megatron_ms"] / ms if row.get("megatron_ms") else None,
            **graph_columns(row, row.get(f"{name}_graph_ms"), gemm, name)}


def graph_columns(row: dict, graph_ms: float | None, gemm: float, kind: str) -> dict:
    """The graphed columns of a variant's row (``kind``: bf16, fp8, quack, quack_gathered) from the bf16 torch row."""
    base = row.get("ours_graph_ms")
    if graph_ms is None:
        return {"ours_graph_ms": None, "frac_of_peak_gemm_graph": None, "fp8_speedup_vs_bf16_graph": None}
    flops = row["ours_tflops"] * row["ours_ms"]  # TFLOP/s x ms: the case's FLOPs / 1e9
    return {"ours_graph_ms": graph_ms, "frac_of_peak_gemm_graph": flops / graph_ms / gemm,
            "fp8_speedup_vs_bf16_graph": base / graph_ms if kind == "fp8" and base else None}


def quack_available(dev: str) -> str | None:
    """None if the quack rows can run here, else why not."""
    from components.errors import UserError
    from components.moe_echo.quack_experts import check_quack_supported

    try:
        check_quack_supported(torch.device(dev))
    except UserError as e:
        return str(e)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of our layer, bf16 and FP8 experts (first case)")
    ap.add_argument("--quick", action="store_true", help="T=4096 only (smoke run)")
    ap.add_argument("--tokens", type=int, default=None, help="T for every case (default: each case's own)")
    ap.add_argument("--case", type=int, action="append", default=None,
                    help="index into CASES to run (repeatable; default all)")
    ap.add_argument("--routing", choices=["balanced", "skewed"], action="append", default=None,
                    help="routing to run (repeatable; default both)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8-experts rows")
    ap.add_argument("--megatron-dispatcher", default="allgather", choices=["allgather", "alltoall"],
                    help="Megatron's token dispatcher (at EP=1 both permute locally; allgather is its default)")
    a = ap.parse_args()
    dev = "cuda"
    global PROFILE, FP8, QUACK
    PROFILE = a.profile
    why = quack_available(dev)
    QUACK = why is None
    print(f"quack rows: {'measured' if QUACK else 'not measured (' + why + ')'}", flush=True)
    FP8 = not a.no_fp8 and torch.cuda.get_device_capability() >= (9, 0)
    MEGATRON["dispatcher"] = a.megatron_dispatcher
    reason = megatron_layer.unavailable()
    if reason is None:
        megatron_layer.init_megatron(dev)
        MEGATRON["ok"] = True
        print(f"megatron_ms: megatron-core {megatron_layer.version()}, experts {megatron_layer.expert_path(dev)}, "
              f"dispatcher {a.megatron_dispatcher}", flush=True)
    else:
        print(f"megatron_ms: not measured ({reason})", flush=True)
    rows = []
    gemm = plain_gemm_tflops(dev)
    gemm8 = plain_fp8_gemm_tflops(dev) if FP8 else None
    print(f"plain GEMM 16384x4096x4096: bf16 {gemm:.0f} TFLOP/s, fp8 rowwise {gemm8 or 0:.0f} TFLOP/s", flush=True)
    cases = [CASES[i] for i in a.case] if a.case else CASES
    for T, D, H, E, K in cases:
        for routing in a.routing or ("balanced", "skewed"):
            row = run_case(4096 if a.quick else a.tokens or T, D, H, E, K, routing, dev)
            row.update(precision="bf16", experts_gemm="torch", plain_gemm_tflops=gemm,
                       frac_of_peak_gemm=row["ours_tflops"] / gemm, **graph_columns(row, row["ours_graph_ms"], gemm, "bf16"))
            rows.append(row)
            print(rows[-1], flush=True)
            if FP8:
                rows += [fp8_row(row, gemm8), fp8_row(row, gemm8, "copies")]
            if QUACK:
                rows += [quack_row(row, gemm), quack_row(row, gemm, "quack_gathered")]
            torch.cuda.empty_cache()
    env = environment()
    cols = ["T", "D", "H", "E", "K", "routing", "precision", "fp8_weights", "experts_gemm", "load_max_over_mean", "ours_ms",
            "fp8_copy_write_ms", "torchtitan_ms",
            "dense_ms", "megatron_ms", "ours_tflops", "torchtitan_tflops", "dense_tflops", "megatron_tflops",
            "plain_gemm_tflops", "frac_of_peak_gemm", "speedup_vs_torchtitan", "speedup_vs_megatron", "frac_of_dense",
            "fp8_speedup_vs_bf16", "ours_graph_ms", "frac_of_peak_gemm_graph", "fp8_speedup_vs_bf16_graph",
            "quack_speedup_vs_torch", "quack_out_rel_diff", "routing_agree", "out_rel_diff", "fp8_out_rel_diff", "fp8_copies_out_rel_diff", "megatron_path",
            "megatron_routing_agree", "megatron_out_rel_diff"]
    table = markdown_table(rows, cols)
    name = "moe_layer" if not (a.tokens or a.case or a.routing) else f"moe_layer_T{a.tokens or 'x'}"  # partial runs apart
    stem = write_results(name, env, rows, table, a.out)
    print(f"\nMoE layer fwd+bwd, {env['gpu']}, torch {env['torch']}  ({stem}.json)\n{table}")
    if MEGATRON["ok"]:
        megatron_layer.teardown_megatron()


if __name__ == "__main__":
    main()
