"""The output head and the loss, forward + backward, on one GPU, CUDA-graphed: h [T, D] -> logits [T, V] ->
cross-entropy (kernels/cross_entropy.py) -> gradients of h and W. Four heads:

- ``bf16``: ``nn.Linear`` in bf16 (cuBLAS);
- ``torchao``: torchao's tensorwise ``Float8Linear``, compiled (what ``compile_ends`` makes of it): the loss writes
  the logits' gradient in bf16, the head takes its amax, then casts and transposes it;
- ``fp8_head_all``: ``components/train/fp8_head.py`` with its three GEMMs in FP8: the loss writes that gradient in
  FP8, in both layouts, in one pass;
- ``fp8_head``: the same head as the recipe converts it, its input gradient in bf16: the loss writes the gradient
  in bf16 and, transposed, in FP8 for the weight gradient's GEMM, in one pass;
- ``fp8_head_cast``: that head without the loss's FP8 form (the loss called without the handoff): the head casts
  the bf16 gradient itself, an amax pass and a pass writing both layouts.

Each row: median ms of one graph replay, and the ratio to bf16 and to torchao's. The GEMMs alone take
6·T·D·V FLOPs (T·D·V multiply-adds, three times).

    python benchmarks/fp8_head.py --tokens 16384 --dim 2048 --vocab 32768     (v2lite_1b's head)
"""

import argparse
import copy

import torch
from torch import nn

from benchmarks.common import environment, graphed, markdown_table, time_ms, write_results
from components.train.fp8_head import GEMMS, Fp8Head
from components.train.loss import lm_loss
from kernels.cross_entropy import cross_entropy


def heads(D: int, V: int) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(D, V, bias=False, device="cuda", dtype=torch.bfloat16)
    nn.init.normal_(linear.weight, std=D**-0.5)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ao = nn.Sequential(copy.deepcopy(linear))
    convert_to_float8_training(ao, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    ao = ao[0]
    ao.forward = torch.compile(ao.forward, fullgraph=True, dynamic=False)
    every = Fp8Head.from_linear(copy.deepcopy(linear))
    every.fp8_gemms = GEMMS
    default = Fp8Head.from_linear(copy.deepcopy(linear))
    return {"bf16": linear, "torchao": ao, "fp8_head_all": every, "fp8_head": default, "fp8_head_cast": default}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args()
    T, D, V = args.tokens, args.dim, args.vocab
    h = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (1, T), device="cuda")
    rows = []
    for name, head in heads(D, V).items():
        hg = h.clone().requires_grad_()

        def step(head=head, hg=hg, handoff=name != "fp8_head_cast"):
            head.weight.grad, hg.grad = None, None
            logits = head(hg)
            loss = (lm_loss(logits, labels) if handoff else
                    cross_entropy(logits.flatten(0, 1), labels.flatten()))  # no FP8 form: the head casts
            loss.backward()

        ms = time_ms(graphed(step), iters=args.iters)
        rows.append({"head": name, "tokens": T, "dim": D, "vocab": V, "ms": round(ms, 3),
                     "gemm_tflops": int(round(6 * T * D * V / ms / 1e9))})
    by = {r["head"]: r["ms"] for r in rows}
    for r in rows:
        r["vs_bf16"] = round(by["bf16"] / r["ms"], 3)
        r["vs_torchao"] = round(by["torchao"] / r["ms"], 3)
    table = markdown_table(rows, ["head", "tokens", "dim", "vocab", "ms", "gemm_tflops", "vs_bf16", "vs_torchao"])
    print(table)
    print(write_results("fp8_head", environment(), rows, table, args.out))


if __name__ == "__main__":
    main()
